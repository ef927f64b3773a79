"""The one error type of the data path."""

from nsa_flex.errors import UserError


class DatasetError(UserError, ValueError):
    """Unknown dataset name, missing path, unreadable or corrupt data file or record (named in the
    message with its line or row)."""
