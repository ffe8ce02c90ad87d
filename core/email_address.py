"""The one canonical form of an e-mail address: the mailbox that mail sent to it reaches.

Accounts are stored, looked up and kept unique by it (marketplace.models.User.email_canonical), and the per-address
limits on e-mails and log-ins count by it (core.login_throttle), so that two spellings are one account, one
budget, exactly when the mail server gets one address for them.

- The domain is IDNA-encoded to ASCII as Django's mail sending does (django.core.mail.message.sanitize_address:
  Python's IDNA 2003 codec, whose nameprep maps 'ſtripe.com' and full-width 'ｓtripe.com' to 'stripe.com'), then
  put in lower case (DNS names are case-insensitive).
- The local part is put in lower case as accounts keep it and e-mails go to it (Python's str.lower(), as
  marketplace.services.accounts.email_normalize does: typing 'Älice@' signs up, and mails, 'älice@'). Nothing else
  is folded: not by case-insensitive Unicode matching, which merges mailboxes that delivery keeps apart.

PostgreSQL's `iexact` (UPPER) is not this: it folds the dotless 'ı' onto 'I' (so 'gıthub.com', a domain of its
own, xn--gthub-n4a.com, matched github.com) and the long 'ſ' onto 'S'.
"""
from core.errors import ValidationFailed

# An account's canonical address fits here (marketplace.models.User.email_canonical): the address is at most 254
# characters, and IDNA makes each label of the domain at most 63 ASCII characters.
CANONICAL_MAX_LENGTH = 1024

_ASCII_LOWER = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")


class UndeliverableAddress(ValidationFailed):
    """The domain cannot be encoded for delivery (an empty label, a label over 63 characters once encoded, a
    character IDNA refuses): no e-mail could reach the address (400 on `email`)."""

    def __init__(self, field: str = "email") -> None:
        super().__init__("This address cannot receive e-mail: its domain cannot be encoded for delivery (IDNA), "
                         "for example a part of it between dots is empty or too long. Check the address.",
                         field=field)


def email_canonical(address: str, *, field: str = "email") -> str:
    """The canonical form of `address` (see the module's docstring). UndeliverableAddress (ValidationFailed on
    `field`) when there is no '@' or the domain cannot be encoded."""
    local, at, domain = address.strip().lower().rpartition("@")
    if not at or not local or not domain:
        raise UndeliverableAddress(field)
    try:
        ascii_domain = domain.encode("idna").decode("ascii")
    except UnicodeError:
        raise UndeliverableAddress(field) from None
    canonical = f"{local}@{ascii_domain.translate(_ASCII_LOWER)}"
    if len(canonical) > CANONICAL_MAX_LENGTH:
        raise UndeliverableAddress(field)
    return canonical
