"""Forms for sign-up and invitation acceptance (the auth views use Django's own)."""

from __future__ import annotations

from django import forms
from django.contrib.auth import get_user_model, password_validation
from django.contrib.auth.forms import AuthenticationForm
from django.core.validators import validate_slug

from .models import Tenant

RESERVED_SLUGS = frozenset({"admin", "api", "accounts", "console", "billing", "static", "www", "gpushare"})


class EmailLoginForm(AuthenticationForm):
    """Django's login form, labelled for what users sign in with: their email."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        field = self.fields["username"]
        field.label = "Email"
        field.widget.attrs.update({"autocomplete": "username", "inputmode": "email", "placeholder": "you@example.com"})
        self.error_messages["invalid_login"] = (
            "That email and password do not match an account (both are case-sensitive)."
        )


class PasswordPairMixin:
    def clean(self):
        data = super().clean()
        first, second = data.get("password1"), data.get("password2")
        if first and second and first != second:
            self.add_error("password2", "The two passwords differ.")
        elif first:
            try:
                password_validation.validate_password(first)
            except forms.ValidationError as exc:
                self.add_error("password1", exc)
        return data


class SignupForm(PasswordPairMixin, forms.Form):
    organisation = forms.CharField(label="Organisation name", max_length=200)
    slug = forms.CharField(
        label="Short name",
        max_length=63,
        min_length=3,
        validators=[validate_slug],
        help_text="Letters, digits and hyphens; used in URLs and on invoices.",
    )
    email = forms.EmailField(label="Your email (your login)")
    password1 = forms.CharField(label="Password", widget=forms.PasswordInput, strip=False)
    password2 = forms.CharField(label="Password again", widget=forms.PasswordInput, strip=False)

    def clean_slug(self) -> str:
        slug = self.cleaned_data["slug"].lower()
        if slug in RESERVED_SLUGS or Tenant.objects.filter(slug=slug).exists():
            raise forms.ValidationError("This short name is taken; choose another.")
        return slug

    def clean_email(self) -> str:
        email = self.cleaned_data["email"].strip().lower()
        if get_user_model().objects.filter(username__iexact=email).exists():
            raise forms.ValidationError("An account with this email exists: log in instead.")
        return email


class InviteAcceptForm(PasswordPairMixin, forms.Form):
    password1 = forms.CharField(label="Choose a password", widget=forms.PasswordInput, strip=False)
    password2 = forms.CharField(label="Password again", widget=forms.PasswordInput, strip=False)
