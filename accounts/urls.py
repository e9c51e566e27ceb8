"""/accounts/: Django's auth views (login, logout, password reset: names unchanged), sign-up, invitations."""

from django.urls import include, path

from . import views

urlpatterns = [
    path("signup/", views.signup, name="signup"),
    path("invite/<str:secret>/", views.invite, name="invite_accept"),
    path("", include("django.contrib.auth.urls")),
]
