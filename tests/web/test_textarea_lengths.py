"""A textarea's max_length is checked on its text with LF line breaks (marketplace.web.fields.TextareaField): a
browser sends CRLF but counts each line break as one character, as the API counts a JSON "\n". Checked as sent, a
16,000-character on-start script of 1,230 lines arrived as 17,230 characters and was refused though the API takes
it (found by review)."""
import importlib
import pkgutil

import pytest
from django import forms

import marketplace.web
from marketplace.models import Instance, Node
from marketplace.services.instances.options import ONSTART_MAX
from marketplace.web.fields import TextareaField
from marketplace.web.node_forms import NodeMigForm
from tests.factories import make_listed_node
from tests.marketplace.renting_helpers import ed25519_key

pytestmark = pytest.mark.django_db

SCRIPT = "echo 1234567\n" * 1230 + "# padding!"  # 16,000 characters with LF line breaks, 1,230 of them


def test_a_long_script_of_many_lines_is_taken_as_the_api_takes_it(web, funded_renter):
    assert len(SCRIPT) == 16_000 < ONSTART_MAX < len(SCRIPT.replace("\n", "\r\n")) == 17_230
    node = make_listed_node(gpu_model="rtx-a6000", gpu_count=4)
    Node.objects.filter(pk=node.pk).update(inventory={"cuda_version": "12.4"})
    r = web.post(f"/offers/{node.pk}/rent/", {
        "image": "cuda-12-4", "num_gpus": "1", "ssh_public_key": ed25519_key(), "request_token": "t",
        "onstart": SCRIPT.replace("\n", "\r\n")})  # as a browser sends the textarea
    assert r.status_code == 302, r.content.decode()[:3000]
    assert Instance.objects.get(renter=funded_renter).onstart == SCRIPT


def test_a_script_too_long_with_lf_is_still_refused(web, funded_renter):
    node = make_listed_node(gpu_model="rtx-a6000", gpu_count=4)
    r = web.post(f"/offers/{node.pk}/rent/", {
        "image": "cuda-12-4", "num_gpus": "1", "ssh_public_key": ed25519_key(), "request_token": "t",
        "onstart": "x" * (ONSTART_MAX + 1)})
    assert r.status_code == 400 and 'id="id_onstart_errors"' in r.content.decode()
    assert not Instance.objects.exists()


def test_the_mig_layout_counts_a_line_break_once():
    layout = "GPU 0: 7g.80gb" + "\r\n" * 993 + "GPU 1: 7g.80gb"  # 1,021 characters with LF; 2,014 as sent
    form = NodeMigForm({"mig_layout": layout, "mig_prices": "7g.80gb: 1.60\r\n"})
    assert form.is_valid(), form.errors
    assert form.cleaned_data["mig_layout"] == [{"gpu": 0, "profiles": ["7g.80gb"]}, {"gpu": 1, "profiles": ["7g.80gb"]}]


@pytest.mark.parametrize(("form", "name"), [
    ("marketplace.web.forms.SshKeyForm", "public_key"), ("marketplace.web.forms.RentForm", "ssh_public_key")])
def test_a_pasted_key_is_measured_with_lf(form, name):
    module, _, cls = form.rpartition(".")
    field = getattr(importlib.import_module(module), cls).base_fields[name]
    assert field.clean("ssh-ed25519 AAAA test\r\n") == "ssh-ed25519 AAAA test\n"


def _forms():
    for info in pkgutil.iter_modules(marketplace.web.__path__):
        module = importlib.import_module(f"marketplace.web.{info.name}")
        for value in vars(module).values():
            if isinstance(value, type) and issubclass(value, forms.BaseForm) and value.__module__ == module.__name__:
                yield value


def test_every_textarea_with_a_max_length_counts_lf():
    found = []
    for form in _forms():
        for name, field in form.base_fields.items():
            if isinstance(field.widget, forms.Textarea) and getattr(field, "max_length", None) is not None:
                found.append(f"{form.__name__}.{name}")
                assert isinstance(field, TextareaField), f"{form.__name__}.{name} checks its length on CRLF text"
    assert {"RentForm.onstart", "RentForm.ssh_public_key", "SshKeyForm.public_key",
            "NodeMigForm.mig_layout", "NodeMigForm.mig_prices"} <= set(found)
