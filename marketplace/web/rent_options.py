"""The rent page's "Advanced" options: the renter's own image and registry login, env, onstart, ports, minimum CUDA
version. The rules are marketplace.services.instances.options (the API's); this only reads the form's text."""
from django import forms

from core.errors import ValidationFailed
from marketplace.services.instances import options as opts
from marketplace.services.instances.booking import runtime_option_refusal, runtime_refused_options

from .fields import TextareaField

OPTION_FIELDS = ("own_image", "registry_username", "registry_password", "env", "onstart", "ports",
                 "min_cuda_version")


class RentOptionsMixin(forms.Form):
    own_image = forms.CharField(
        label="Your own image", required=False, max_length=opts.REFERENCE_MAX, strip=True,
        widget=forms.TextInput(attrs={"spellcheck": "false", "autocomplete": "off",
                                      "placeholder": "registry.example.com/team/app:1.0"}),
        help_text="Any image reference ([registry/]name[:tag][@sha256:…]); used instead of the image chosen above. "
                  "A bare word is a catalogue image's name, as in the API: a public image needs a tag or a path "
                  "(ubuntu:24.04, library/ubuntu). Not on servers that run virtual machines.")
    registry_username = forms.CharField(label="Registry user name", required=False, max_length=opts.USERNAME_MAX,
                                        widget=forms.TextInput(attrs={"autocomplete": "off"}))
    registry_password = forms.CharField(
        label="Registry password or token", required=False, max_length=opts.PASSWORD_MAX, strip=False,
        widget=forms.PasswordInput(attrs={"autocomplete": "new-password"}, render_value=False),
        help_text="Only for a private image of your own: encrypted, used for the pull, never shown again.")
    env = forms.CharField(
        label="Environment variables", required=False, strip=False,
        widget=forms.Textarea(attrs={"rows": 3, "spellcheck": "false", "placeholder": "API_KEY=...\nMODE=train"}),
        help_text=f"One NAME=value a line; names in capitals, digits and _; at most {opts.ENV_MAX_NAMES}.")
    onstart = TextareaField(
        label="On-start script", required=False, strip=False, max_length=opts.ONSTART_MAX,
        widget=forms.Textarea(attrs={"rows": 4, "spellcheck": "false",
                                     "placeholder": "pip install -r /workspace/requirements.txt"}),
        help_text="Run once by /bin/sh at the first boot, inside the instance; its output is in the logs.")
    ports = forms.CharField(
        label="Ports to expose", required=False, max_length=200,
        widget=forms.TextInput(attrs={"placeholder": "8888, 6006", "inputmode": "numeric"}),
        help_text=f"Container TCP ports (at most {opts.PORTS_MAX}, not 22); each gets a port on the server, "
                  "shown on the instance page.")
    min_cuda_version = forms.CharField(
        label="Minimum CUDA version", required=False, max_length=8,
        widget=forms.TextInput(attrs={"placeholder": "12.2"}),
        help_text="Refuse this server if its driver supports an older CUDA.")

    def limit_options(self, *, node) -> None:
        """The options this server's agent refuses (libvirt: env, on-start script, ports; the booking's rule,
        runtime_refused_options) shown disabled and saying why. Sent anyway, the booking refuses them, naming the
        field."""
        for name in runtime_refused_options(node.runtime):
            if name in self.fields and name in OPTION_FIELDS:
                field = self.fields[name]
                field.widget.attrs["disabled"] = True
                field.help_text = runtime_option_refusal(node.runtime, name)

    def _check(self, name: str, fn, value):
        try:
            return fn(value)
        except ValidationFailed as exc:
            raise forms.ValidationError(exc.message) from None

    def clean_own_image(self):
        """The API's rule (opts.image_of): a reference (with a `/`, `:` or `@`), or a bare word naming a catalogue
        image, which it then is; a misspelt bare word is refused, not pulled as a public image of that name."""
        value = self.cleaned_data["own_image"]
        return self._check("own_image", opts.image_of, value) if value else ""

    def clean_env(self):
        variables: dict[str, str] = {}
        for number, line in enumerate(self.cleaned_data["env"].splitlines(), 1):
            if not line.strip():
                continue
            name, sep, value = line.partition("=")
            if not sep:
                raise forms.ValidationError(f"Line {number} is not NAME=value.")
            if name.strip() in variables:
                raise forms.ValidationError(f"{name.strip()} is given twice.")
            variables[name.strip()] = value
        return self._check("env", opts.clean_env, variables)

    def clean_onstart(self):
        return self._check("onstart", opts.clean_onstart, self.cleaned_data["onstart"])  # LF: TextareaField

    def clean_ports(self):
        words = [w for w in self.cleaned_data["ports"].replace(",", " ").split() if w]
        ports = []
        for word in words:
            if not (word.isascii() and word.isdigit()) or len(word) > 5:
                raise forms.ValidationError(f"{word[:20]!r} is not a port number.")
            ports.append(int(word))
        return self._check("ports", opts.clean_ports, ports)

    def clean_min_cuda_version(self):
        return self._check("min_cuda_version", opts.clean_cuda_version, self.cleaned_data["min_cuda_version"])

    def clean_options(self) -> None:
        """The registry login: both parts or neither, and only with an image of one's own (called from clean)."""
        user, password = self.cleaned_data.get("registry_username"), self.cleaned_data.get("registry_password")
        if not user and not password:
            self.cleaned_data["registry_auth"] = None
            return
        own = self.cleaned_data.get("own_image")  # none, a reference, or a catalogue image named by its slug
        if not (isinstance(own, str) and own) and "own_image" not in self.errors:
            self.add_error("registry_username", "A registry login goes with an image of your own only.")
            return
        try:
            self.cleaned_data["registry_auth"] = opts.clean_registry_auth({"username": user or "",
                                                                           "password": password or ""})
        except ValidationFailed as exc:
            # Under the part it is about (the service's messages name `username` or `password`).
            about_user = not user or "`registry_auth.username`" in exc.message or "`username`" in exc.message
            self.add_error("registry_username" if about_user else "registry_password", exc.message)

    def options(self) -> opts.InstanceOptions:
        data = self.cleaned_data
        return opts.InstanceOptions(env=data.get("env") or {}, onstart=data.get("onstart") or "",
                                    ports=data.get("ports") or [], min_cuda_version=data.get("min_cuda_version") or "",
                                    registry_auth=data.get("registry_auth"))

    def options_given(self) -> bool:
        return any(self[name].value() for name in OPTION_FIELDS if name != "registry_password")
