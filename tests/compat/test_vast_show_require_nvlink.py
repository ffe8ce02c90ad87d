"""`vastai show instance(s)` say whether the instance was booked on one NVLink island (`require_nvlink`, set when
a Vast user books an offer listed with bw_nvlink above 0): before, nothing of it was shown, so a renter could not
tell why a `start instance` was refused for want of one island. The real CLI prints it with --raw and tolerates
it in its table."""
import pytest

from marketplace.models import Instance
from tests.factories import UserFactory, api_key_for
from tests.marketplace.renting_helpers import add_key
from tests.marketplace.test_renting_nvlink import islands_node

from .test_cli import _json, _vastai, vast_home, vastai_venv
from .test_vast_nvlink_booking import PAIRS, _create

__all__ = ["vast_home", "vastai_venv"]

pytestmark = pytest.mark.slow


def test_show_instance_and_instances_say_require_nvlink(live_server, vastai_venv, vast_home, client_for):
    node = islands_node(nvlink=PAIRS, gpu_count=4)
    renter = UserFactory()
    add_key(renter)
    client = client_for(renter)
    booked = {}
    for count in (2, 1):  # 2 GPUs of an offer listed with bw_nvlink 230: one island; 1 GPU: nothing to keep
        r = _create(client, node.pk * 100 + count)
        assert r.status_code == 200, r.content[:300]
        booked[count] = r.json()["new_contract"]
    assert Instance.objects.get(pk=booked[2]).require_nvlink is True
    url, key = live_server.url + "/compat/vast", api_key_for(renter)

    shown = {n: _json(_vastai(url, key, "show", "instance", str(pk))) for n, pk in booked.items()}
    assert (shown[2]["require_nvlink"], shown[1]["require_nvlink"]) == (True, False), shown
    listed = {row["id"]: row["require_nvlink"] for row in _json(_vastai(url, key, "show", "instances"))}
    assert listed == {booked[2]: True, booked[1]: False}
    # The CLI's own tables (no --raw) print their columns and leave it out, without a complaint.
    table = _vastai(url, key, "show", "instances", raw=False)
    assert str(booked[2]) in table.stdout
    _vastai(url, key, "show", "instance", str(booked[2]), raw=False)
