from django import forms
from django.contrib.auth import password_validation
from django.contrib.auth.forms import AuthenticationForm

from marketplace.models import User


class LoginForm(AuthenticationForm):
    username = forms.EmailField(label="Email", widget=forms.EmailInput(attrs={"autofocus": True,
                                                                          "autocomplete": "email"}))

    def clean_username(self):
        return self.cleaned_data["username"].lower()


class SignupForm(forms.Form):
    email = forms.EmailField(widget=forms.EmailInput(attrs={"autocomplete": "email"}))
    password = forms.CharField(widget=forms.PasswordInput(attrs={"autocomplete": "new-password"}), strip=False)

    def clean_email(self):
        email = self.cleaned_data["email"].lower()
        if User.objects.filter(email__iexact=email).exists():
            raise forms.ValidationError("An account with this email already exists.")
        return email

    def clean(self):
        cleaned = super().clean()
        if "email" in cleaned and "password" in cleaned:
            try:
                password_validation.validate_password(cleaned["password"], User(email=cleaned["email"]))
            except forms.ValidationError as exc:
                self.add_error("password", exc)
        return cleaned
