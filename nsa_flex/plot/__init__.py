"""`python -m nsa_flex.plot`: an alias whose `__main__` runs the app `nsa_flex.apps.plot`."""
