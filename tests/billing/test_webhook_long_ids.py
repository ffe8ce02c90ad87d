"""A Stripe event's id and type are stored whole or refused: they were cut to the column's 100 characters, so two
deliveries whose ids agree in their first 100 characters were taken for one event, and the second was counted as a
repeat of the first and never processed."""
import pytest

from billing.models import StripeEvent
from billing.services.webhooks import STRIPE_EVENT_FIELD_MAX
from tests.billing.test_webhook_hardening import deliver

pytestmark = pytest.mark.django_db


def _event(event_id: str, kind: str = "customer.created") -> dict:
    return {"id": event_id, "object": "event", "type": kind, "data": {"object": {"id": "cus_1", "object": "customer"}}}


@pytest.mark.parametrize("field", ["id", "type"])
def test_an_id_or_type_past_the_column_is_refused_by_name_and_nothing_is_stored(anon, field):
    event = _event("evt_" + "a" * 120) if field == "id" else _event("evt_long_type", "x." + "y" * 120)
    response = deliver(anon, event)
    assert response.status_code == 400, response.content
    assert response.json() == {"detail": f"Not a Stripe event: `{field}` has at most {STRIPE_EVENT_FIELD_MAX} "
                                         "characters."}
    assert not StripeEvent.objects.exists()


def test_two_events_alike_in_their_first_100_characters_are_never_taken_for_one(anon):
    """Past the column both are refused; at the column's length both are stored whole, each once."""
    for length in (STRIPE_EVENT_FIELD_MAX + 1, STRIPE_EVENT_FIELD_MAX):
        first, second = "evt_" + "a" * (length - 4), "evt_" + "a" * (length - 5) + "b"
        answers = [deliver(anon, _event(event_id)).status_code for event_id in (first, second)]
        assert not StripeEvent.objects.filter(deliveries__gt=1).exists(), length
        if length > STRIPE_EVENT_FIELD_MAX:
            assert answers == [400, 400] and not StripeEvent.objects.exists()
        else:
            assert answers == [200, 200]
            assert sorted(StripeEvent.objects.values_list("event_id", flat=True)) == [first, second]
