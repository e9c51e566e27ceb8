"""Sign-up and invitation pages; login, logout and password reset are Django's views
with the templates in templates/registration/."""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth import login
from django.db import IntegrityError
from django.shortcuts import redirect, render
from django.views.decorators.http import require_http_methods

from .forms import InviteAcceptForm, SignupForm
from .services import AccountsError, invitation_find, invite_accept, signup_create

BACKEND = "django.contrib.auth.backends.ModelBackend"


@require_http_methods(["GET", "POST"])
def signup(request):
    form = SignupForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        data = form.cleaned_data
        try:
            tenant, user = signup_create(
                organisation=data["organisation"], slug=data["slug"], email=data["email"], password=data["password1"]
            )
        except IntegrityError:
            form.add_error(None, "This short name or email was just taken; try again.")
        else:
            login(request, user, backend=BACKEND)
            messages.success(request, f"Welcome to gpushare: {tenant.name} is ready.")
            return redirect("/")
    return render(request, "accounts/signup.html", {"form": form})


@require_http_methods(["GET", "POST"])
def invite(request, secret: str):
    invitation = invitation_find(secret)
    if invitation is None:
        return render(request, "accounts/invite_invalid.html", status=404)
    signed_in = request.user.is_authenticated
    form = None if signed_in else InviteAcceptForm(request.POST or None)
    if request.method == "POST" and (signed_in or form.is_valid()):
        try:
            membership = invite_accept(
                plaintext=secret,
                user=request.user if signed_in else None,
                password=None if signed_in else form.cleaned_data["password1"],
            )
        except AccountsError as exc:
            if form is None:
                messages.error(request, str(exc))
                return redirect(request.path)
            form.add_error(None, str(exc))
        else:
            if not signed_in:
                login(request, membership.user, backend=BACKEND)
            messages.success(request, f"You joined {membership.tenant.name} as {membership.role}.")
            return redirect("/")
    return render(request, "accounts/invite.html", {"invitation": invitation, "form": form})
