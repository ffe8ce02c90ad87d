"""Server-rendered pages. Thin: every rule lives in a service or selector."""
from django.contrib.auth import login
from django.contrib.auth.views import LoginView
from django.shortcuts import redirect, render
from django.views.decorators.http import require_http_methods

from marketplace.services.accounts import EmailTaken, user_register

from .forms import LoginForm, SignupForm


def home(request):
    return render(request, "marketplace/home.html")


class EmailLoginView(LoginView):
    template_name = "marketplace/login.html"
    authentication_form = LoginForm
    redirect_authenticated_user = True


@require_http_methods(["GET", "POST"])
def signup(request):
    form = SignupForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        try:
            user, api_key = user_register(email=form.cleaned_data["email"], password=form.cleaned_data["password"])
        except EmailTaken:
            form.add_error("email", "An account with this email already exists.")
        else:
            login(request, user, backend="django.contrib.auth.backends.ModelBackend")
            # The key is shown once, on the very next page, then forgotten.
            return render(request, "marketplace/signup_done.html", {"api_key": api_key})
    return render(request, "marketplace/signup.html", {"form": form})


@require_http_methods(["POST"])
def logout_view(request):
    from django.contrib.auth import logout

    logout(request)
    return redirect("home")
