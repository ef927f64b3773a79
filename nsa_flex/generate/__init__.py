"""`python -m nsa_flex.generate`: an alias whose `__main__` runs the app `nsa_flex.apps.generate`."""
