"""Whether the Hugging Face hub can be reached, asked once before streaming from it."""

import urllib.error
import urllib.request

from huggingface_hub import constants


def hub_unreachable(timeout: float = 5.0) -> str | None:
    """Why the Hugging Face hub cannot be reached (offline mode set, or one HTTPS request to its
    endpoint failing within ``timeout`` s), or None when it answers (any HTTP status)."""
    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    try:
        urllib.request.urlopen(urllib.request.Request(constants.ENDPOINT, method="HEAD"), timeout=timeout)
    except urllib.error.HTTPError:
        return None  # it answered
    except Exception as e:  # DNS, refused, timeout, proxy
        return f"{constants.ENDPOINT}: {type(e).__name__}: {getattr(e, 'reason', e)}"
    return None
