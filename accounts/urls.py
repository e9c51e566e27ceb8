"""/accounts/: Django's auth views (login, logout, password reset: names unchanged), sign-up, invitations."""

from django.contrib.auth.views import LoginView
from django.urls import include, path

from . import views
from .forms import EmailLoginForm

urlpatterns = [
    path("login/", LoginView.as_view(authentication_form=EmailLoginForm), name="login"),
    path("signup/", views.signup, name="signup"),
    path("invite/<str:secret>/", views.invite, name="invite_accept"),
    path("", include("django.contrib.auth.urls")),
]
