"""How long a password may be: when it is set, and when it is typed to be checked.

Set: every way a password is chosen (sign-up on the API and the page, the change page, a reset link, the admin's
forms, createsuperuser) runs Django's AUTH_PASSWORD_VALIDATORS, so MaximumLengthValidator there holds them all to one
limit (PASSWORD_MAX_LENGTH in marketplace.validators, 128). Before, only sign-up had a limit (its fields'), a longer
password could be set by a change or a reset link, and then every field that checks a password refused it as too
long: its owner was locked out of the API's log-in and of every page that asks for the password again.

Checked: a typed password is never refused for being longer than that limit, so an account that holds a longer one
(set before the limit) still logs in and confirms. Only an absurd length, over PASSWORD_CHECK_MAX_LENGTH, is
refused as a wrong password, before the lock-out and without hashing it. Not that the hashers in use need it (PBKDF2
and Argon2 digest a long password once, not once per iteration), but a request body may be megabytes, and a bound
keeps the work of an anonymous request small whatever hasher is configured; 4096 is what Django itself once
capped (CVE-2013-1443), far above anything a person or a password manager makes. It is refused as wrong, not as
too long: the answer is the same as any wrong password's, and no account's password can be that long unless a
change page set it before the set limit existed (it can still be reset by e-mail).
"""

from django.core.exceptions import ValidationError

PASSWORD_CHECK_MAX_LENGTH = 4096


def password_checkable(password: str) -> bool:
    """May this typed password be checked (hashed) at all? False: answer it as a wrong password."""
    return len(password) <= PASSWORD_CHECK_MAX_LENGTH


class MaximumLengthValidator:
    """A password validator (AUTH_PASSWORD_VALIDATORS): at most `max_length` characters."""

    def __init__(self, max_length: int = 128):
        self.max_length = max_length

    def validate(self, password: str, user: object = None) -> None:
        if len(password) > self.max_length:
            raise ValidationError(
                "This password is too long: at most %(max_length)d characters (it has %(length)d).",
                code="password_too_long",
                params={"max_length": self.max_length, "length": len(password)},
            )

    def get_help_text(self) -> str:
        return f"Your password must have at most {self.max_length} characters."
