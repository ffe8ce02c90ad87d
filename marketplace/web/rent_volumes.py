"""The rent page's volumes: tick the renter's volumes on this server and give each a mount path. The rules (the
renter's own, on this node, available and not mounted elsewhere, a good and distinct mount path) are the booking's
(marketplace.services.volumes.volume_mounts_for_booking), so the page shows the API's messages."""
from typing import Any

from django import forms

from marketplace.models import Volume
from marketplace.services import volumes as volume_svc

DEFAULT_MOUNT = "/data"


class _VolumeIds(forms.MultipleChoiceField):
    """Ticked volume ids. Any whole number passes here: whose volume it is, and where, the booking checks (with the
    API's words), so a tampered id is refused like the API refuses it."""

    def valid_value(self, value):
        return str(value).isascii() and str(value).isdigit() and len(str(value)) <= 18


class RentVolumesMixin(forms.Form):
    volumes = _VolumeIds(label="Volumes to mount", required=False, widget=forms.CheckboxSelectMultiple)

    def setup_volumes(self, *, user, node) -> None:
        """The renter's volumes on this server as choices, each with its mount-path field `mount_<id>`; none, and
        the reason (`volumes_refused`), on a server whose VMs mount no volume (the booking refuses them there)."""
        self.volumes_refused = "" if volume_svc.node_mounts_volumes(node) else (
            "This server runs virtual machines (libvirt), which cannot mount volumes yet: pick a docker server to "
            "mount one.")
        self.volume_rows: list[Volume] = [] if self.volumes_refused else list(
            volume_svc.volumes_for_user(user=user).filter(node_id=node.pk).order_by("pk"))
        volumes_field = self.fields["volumes"]
        assert isinstance(volumes_field, forms.ChoiceField)
        if self.volumes_refused:
            volumes_field.choices = []
            volumes_field.help_text = self.volumes_refused
            return
        volumes_field.choices = [
            (str(v.pk), f"{v.name}{f' ({v.label})' if v.label else ''}: {v.size_gb} GB, {v.get_state_display()}")
            for v in self.volume_rows]
        self.fields["volumes"].help_text = (
            "Your volumes on this server, kept after the instance is destroyed." if self.volume_rows else
            "You have no volume on this server; make one on the Volumes page to keep data across instances.")
        for n, volume in enumerate(self.volume_rows):
            self.fields[f"mount_{volume.pk}"] = forms.CharField(
                label=f"Mount path of {volume.name}", required=False, max_length=300, strip=True,
                initial=DEFAULT_MOUNT if n == 0 else f"{DEFAULT_MOUNT}{n + 1}",
                widget=forms.TextInput(attrs={"spellcheck": "false", "autocomplete": "off"}))

    def mount_fields(self) -> list[forms.BoundField]:
        return [self[f"mount_{v.pk}"] for v in getattr(self, "volume_rows", [])]

    def clean_volumes(self) -> list[dict[str, Any]]:
        """[{"volume": id, "mount": path}] in the order ticked, as the API's `volumes` (checked at booking)."""
        specs = []
        for value in self.cleaned_data["volumes"]:
            mount = (self.data.get(f"mount_{value}") or "").strip()
            specs.append({"volume": int(value), "mount": mount or None})
        return specs

    def volumes_given(self) -> bool:
        return bool(self["volumes"].value())
