"""Instances: `create instance` (PUT /asks/ID/), `show instance(s)`, stop/start/label/destroy; our states on Vast's
four (`actual_status`), ours in `status_msg`."""
import base64
import hashlib
import json
import math
import re
from collections import Counter
from functools import cmp_to_key
from typing import Any

from django.core.cache import cache
from django.db import transaction
from django.db.models import Q
from django.utils import timezone
from rest_framework.request import Request
from rest_framework.response import Response

from core.api.idempotency import idempotency_key as idempotency_key_of
from core.api.scopes import RENTER_ONLY
from core.errors import ApplicationError, Conflict, NotFound, ValidationFailed
from core.untrusted_json import Refused, loads
from marketplace.mig import profiles_for
from marketplace.models import Image, Instance, InstanceStatus, SshKey
from marketplace.services import instances as instance_svc
from marketplace.services.disk_room import DiskDoesNotFit
from marketplace.services.email_verification import email_verified_required
from marketplace.services.instances import options as opts

from .. import booking, offers, query
from .base import VastView, _body, _epoch, _label, _refuse_unknown, _user

S = InstanceStatus
# Our states on Vast's (`actual_status`); `status_msg` carries ours, and its reason. Interrupted (its node stopped
# answering) is Vast's "unknown", no recent heartbeat from the host: as "loading" a script waiting for "running"
# took it for a boot and waited on.
ACTUAL_STATUS: dict[str, str] = {
    S.REQUESTED: "created", S.PROVISIONING: "loading", S.STARTING: "loading", S.INTERRUPTED: "unknown",
    S.RUNNING: "running", S.STOPPING: "exited", S.STOPPED: "exited", S.FAILED: "exited",
    S.DESTROYING: "exited", S.DESTROYED: "exited",
}
INTENDED_STATUS: dict[str, str] = {
    S.STOPPING: "stopped", S.STOPPED: "stopped", S.FAILED: "stopped", S.DESTROYING: "stopped", S.DESTROYED: "stopped",
}
# Where a PUT state=stopped has nothing left to do: `show instance` says intended "stopped" (a destroyed one is gone
# from `show`, and a PUT of it a 409).
STOP_DONE = {status for status in INTENDED_STATUS if status != S.DESTROYED}
# Where a PUT state=running has nothing left to do: `show instance` says intended "running" (booting, starting,
# interrupted: it resumes by itself). Found by review r54: these answered 409 and the CLI reported a failure.
START_DONE = {status for status in S.values if status not in INTENDED_STATUS}




def _gpu_name_and_ram(instance: Instance) -> tuple[str, int | None]:
    """Vast's `gpu_name` and `gpu_ram` (MiB per GPU) of the instance. A MIG instance's "GPUs" are slices: the
    profile is named after the model ("A100 80GB SXM MIG 1g.10gb", what `show instances` prints as Model) and the
    memory is the slice's share of the card (marketplace.mig), not the whole card's."""
    model = instance.gpu_model
    if not instance.mig_profile:
        return model.name, model.memory_mib
    profile = profiles_for(model.slug).get(instance.mig_profile)
    return f"{model.name} MIG {instance.mig_profile}", profile.memory_mib(model.memory_mib) if profile else None


def instance_row(instance: Instance) -> dict[str, Any]:
    node = instance.node
    running = instance.status == S.RUNNING
    message = instance.status_message
    gpu_name, gpu_ram = _gpu_name_and_ram(instance)
    return {
        "id": instance.pk, "machine_id": instance.node_id,
        "actual_status": ACTUAL_STATUS.get(instance.status, "exited"),
        "intended_status": INTENDED_STATUS.get(instance.status, "running"),
        "cur_state": "running" if running else "stopped",
        "status_msg": f"{instance.status}: {message}" if message else instance.status,
        "num_gpus": instance.num_gpus, "gpu_name": gpu_name, "gpu_ram": gpu_ram,
        "gpu_totalram": gpu_ram * instance.num_gpus if gpu_ram is not None else None,
        "mig_profile": instance.mig_profile or None,
        # Booked on one NVLink island (an offer listed with bw_nvlink above 0): its start keeps it so, or is refused.
        # Vast has no such column; the CLI prints --raw as is and its table only the columns it knows.
        "require_nvlink": instance.require_nvlink,
        "disk_space": instance.disk_gb, "image_uuid": instance.image_name, "image_runtype": "ssh",
        "label": instance.label or None,
        "extra_env": [[name, instance_svc.ENV_VALUE_MASK] for name in instance.env_names],  # values never shown
        "ports": {name: [{"HostIp": where["host"], "HostPort": str(where["port"])}]
                  for name, where in instance.ports.items()} if running else {},
        "os_version": instance.os or None,
        "ssh_host": instance.ssh_host if running and instance.ssh_host else None,
        "ssh_port": instance.ssh_port if running else None,
        "ssh_user": (instance.ssh_user or "root") if running else None,
        "dph_total": offers.usd(instance.price_per_hour_micros), "dph_base": offers.usd(instance.price_per_hour_micros),
        # USD per GB per 30-day month for its disk while stopped: its node's disk price at booking (what
        # /api/v1/instances/' disk_price_per_gb_month says), exact from integer micros as search offers' storage_cost.
        "storage_cost": offers.usd(instance.disk_price_per_gb_month_micros),
        "start_date": _epoch(instance.created_at), "end_date": None,
        "uptime_mins": (timezone.now() - instance.started_at).total_seconds() / 60
        if running and instance.started_at else None,
        "reliability2": node.reliability, "verification": node.verdict, "geolocation": str(node.country) or None,
    }


def _own_instances(request: Request):
    return instance_svc.instances_for_user(user=_user(request)).select_related("node")


def _own_instance(request: Request, instance_id: int) -> Instance:
    instance = _own_instances(request).filter(pk=instance_id).first()
    if instance is None:
        raise NotFound(f"No instance {instance_id}.")
    return instance


# What `show instances` may filter (`--status`, `--label`, `--gpu-name`, `--verification`) and order on.
INSTANCE_COLUMNS = {"id", "machine_id", "actual_status", "intended_status", "label", "gpu_name", "num_gpus",
                    "verification", "geolocation", "image_uuid", "start_date", "dph_total", "disk_space",
                    "storage_cost"}


def _compare(column: str, op: str, have: Any, want: Any) -> bool:
    if op in query.ORDERED_OPERATORS and not isinstance(have, int | float):
        return False
    # As search offers compares: the CLI sends `--gpu-name RTX_A6000` as typed (the row says "RTX A6000").
    return query.compare(op, have, want, query.norm_for(column))


def _json_param(request: Request, name: str, default: Any) -> Any:
    text = request.query_params.get(name)
    if text is None:
        return default
    try:
        return loads(text)
    except Refused as exc:
        raise ValidationFailed(f"`{name}`: {exc}", field=name) from None
    except ValueError:
        raise ValidationFailed(f"`{name}` is JSON.", field=name) from None


def _whole(request: Request, name: str, default: int, low: int, high: int) -> int:
    text = request.query_params.get(name)
    if text is None or text == "":
        return default
    return query.whole(text, name, low=low, high=high)  # "5.0" too, as a JSON encoder writes a float


# `next_token`: the last row's order-by values (the order's columns and `id`, which makes the order total), so the
# next page starts strictly after that row. An offset skipped an instance whenever one before it was destroyed
# between two pages (found by review); the CLI and SDK page until next_token is empty and send it back as is.
# The token also names the listing's order as its first page made it (the ids in order, kept in the cache for
# PAGE_SNAPSHOT_SECONDS): later pages go on in that order, each row read as it is now. Keyset paging over the
# order-by values alone skipped an instance whose label or status moved it before the last row shown between two
# pages, and showed one twice that moved after it (found by review); ids cannot move. A token whose listing is no
# longer kept pages by the values, as before.
TOKEN_MAX_CHARS = 4096
PAGE_SNAPSHOT_SECONDS = 3600
_SNAPSHOT_NAME = re.compile(r"[A-Za-z0-9_-]{1,32}")
PAGE_CURSOR_REFUSED = ("`after_token` is the `next_token` of an earlier page of `show instances`, sent back as it "
                       "is, with the same order_by.")


def _order_of(order_by: Any) -> list[tuple[str, bool]]:
    """`order_by` as (column, descending) pairs, `id` ascending appended when absent: a total order."""
    if not isinstance(order_by, list):
        raise ValidationFailed("`order_by` is [{\"col\": ..., \"dir\": \"asc\"|\"desc\"}].", field="order_by")
    order: list[tuple[str, bool]] = []
    for item in order_by:
        # isinstance before `in`: a list or an object is no key of the set (a TypeError, a 500).
        if not isinstance(item, dict) or not isinstance(item.get("col"), str) \
                or item["col"] not in INSTANCE_COLUMNS or item.get("dir", "asc") not in ("asc", "desc"):
            raise ValidationFailed(f"`order_by` is [{{\"col\": COLUMN, \"dir\": \"asc\"|\"desc\"}}], columns: "
                                   f"{', '.join(sorted(INSTANCE_COLUMNS))}.", field="order_by")
        # A column again orders nothing more, nor does any after `id` (unique): left out, so that the page token
        # (every column's value) stays short; a label ordered by three times made a 414 of the next page's URL.
        if item["col"] not in {column for column, _ in order} and ("id", False) not in order \
                and ("id", True) not in order:
            order.append((item["col"], item.get("dir") == "desc"))
    if "id" not in {column for column, _ in order}:
        order.append(("id", False))
    return order


def _key(row: dict[str, Any], order: list[tuple[str, bool]]) -> list[Any]:
    return [row.get(column) for column, _ in order]


def _compare_keys(a: list[Any], b: list[Any], order: list[tuple[str, bool]]) -> int:
    """-1, 0 or 1 as row key `a` comes before, with or after `b`: column by column, each in its direction, a
    missing value (None) after every other in either direction."""
    for (_, descending), x, y in zip(order, a, b, strict=True):
        if x == y:
            continue
        if x is None or y is None:
            return 1 if x is None else -1
        before = x < y
        return -1 if before != descending else 1
    return 0


def _token_of(row: dict[str, Any], order: list[tuple[str, bool]], snapshot: str) -> str:
    text = json.dumps({"o": [[column, descending] for column, descending in order], "v": _key(row, order),
                       "s": snapshot}, separators=(",", ":"))
    return base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")


def _snapshot_key(request: Request, snapshot: str) -> str:
    return f"compat.vast.instance-pages:{_user(request).pk}:{snapshot}"


def _keep_snapshot(request: Request, ids: list[int]) -> str:
    """The name of the listing `ids` (its ids in order), kept for PAGE_SNAPSHOT_SECONDS. Named by its content: a
    first page that lists the same ids in the same order reuses the kept one (and keeps it longer) rather than write
    another. A random name per first page made a script polling `show instances` write ~1000 keys an hour (found by
    review); now a new one is written only when the listing itself changed. One name is always the same listing, so
    a token of an earlier first page still pages over exactly what that page began."""
    snapshot = base64.urlsafe_b64encode(hashlib.sha256(json.dumps(ids).encode()).digest()[:24]).decode()
    key = _snapshot_key(request, snapshot)
    if not cache.touch(key, PAGE_SNAPSHOT_SECONDS):
        cache.set(key, ids, PAGE_SNAPSHOT_SECONDS)
    return snapshot


def _after(token: str, order: list[tuple[str, bool]]) -> tuple[list[Any], str | None]:
    """The key of the row `token` names and the name of its listing's order (None in a token without one); a 400
    for one no earlier page of this order handed out."""
    bad = ValidationFailed(PAGE_CURSOR_REFUSED, field="after_token")
    if len(token) > TOKEN_MAX_CHARS:
        raise bad
    try:
        data = loads(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)).decode())
    except ValueError:  # not base64, not UTF-8, not JSON (binascii.Error, UnicodeDecodeError, Refused)
        raise bad from None
    if not isinstance(data, dict) or data.get("o") != [[column, descending] for column, descending in order]:
        raise bad
    values = data.get("v")
    # By type: True is no column's value (and would compare as 1).
    if not isinstance(values, list) or len(values) != len(order) \
            or not all(v is None or type(v) in (str, int, float) for v in values):
        raise bad
    snapshot = data.get("s")
    if snapshot is not None and not (isinstance(snapshot, str) and _SNAPSHOT_NAME.fullmatch(snapshot)):
        raise bad
    return values, snapshot


class InstanceListView(VastView):
    """GET /api/v1/instances/ (under /compat/vast): `vastai show instances`, all columns, one page at a time."""

    api_scope = RENTER_ONLY  # core/api/scopes.py

    def get(self, request):
        filters = _json_param(request, "select_filters", {})
        order = _order_of(_json_param(request, "order_by", [{"col": "id", "dir": "asc"}]))
        limit = _whole(request, "limit", 25, 1, 25)
        token = request.query_params.get("after_token") or ""
        after, snapshot = _after(token, order) if token else (None, None)
        rows = [instance_row(i) for i in _own_instances(request).exclude(status=S.DESTROYED).order_by("id")]
        if not isinstance(filters, dict):
            raise ValidationFailed("`select_filters` is {column: {operator: value}}.", field="select_filters")
        for column, spec in filters.items():
            if column not in INSTANCE_COLUMNS or not isinstance(spec, dict):
                raise ValidationFailed(f"Cannot filter on `{column}` (columns: {', '.join(sorted(INSTANCE_COLUMNS))})"
                                       ".", field="select_filters")
            for op, value in spec.items():
                if op not in query.OPERATORS or (op in ("in", "notin") and not isinstance(value, list)):
                    raise ValidationFailed(f"Unknown operator `{op}` for `{column}`.", field="select_filters")
                if op in query.ORDERED_OPERATORS and not isinstance(value, int | float):
                    raise ValidationFailed(f"`{column}` `{op}` takes a number.", field="select_filters")
                rows = [r for r in rows if _compare(column, op, r[column], value)]
        rows.sort(key=cmp_to_key(lambda a, b: _compare_keys(_key(a, order), _key(b, order), order)))
        # The listing's order as an earlier page made it: the rows after the last one shown in it, as they are now
        # (one destroyed or no longer matching the filters is left out; one made since, or matching only since, is
        # not in this listing).
        ids = cache.get(_snapshot_key(request, snapshot)) if snapshot and after is not None else None
        position = ids.index(after[-1]) + 1 if isinstance(ids, list) and after and after[-1] in ids else None
        if ids is not None and position is not None:
            by_id = {r["id"]: r for r in rows}
            left = [by_id[pk] for pk in ids[position:] if pk in by_id]
        else:
            snapshot = None
            left = rows
            if after is not None:
                try:
                    left = [r for r in rows if _compare_keys(_key(r, order), after, order) > 0]
                except TypeError:  # a value of another type than the column's (text for a number)
                    raise ValidationFailed(PAGE_CURSOR_REFUSED, field="after_token") from None
        page = left[:limit]
        next_token = None
        if len(left) > limit:
            if snapshot is None:  # the first page (or one whose listing is no longer kept): this order is kept
                snapshot = _keep_snapshot(request, [r["id"] for r in left])
            next_token = _token_of(page[-1], order, snapshot)
        return Response({
            "instances": page, "next_token": next_token,
            "total_instances": len(rows), "label_counts": dict(Counter(r["label"] or "" for r in rows)),
        })


class InstanceFiltersView(VastView):
    """GET /api/v0/instances/filters/: the values `show instances` offers to filter on (its table's panel)."""

    api_scope = RENTER_ONLY  # core/api/scopes.py

    def get(self, request):
        rows = [instance_row(i) for i in _own_instances(request).exclude(status=S.DESTROYED)]
        combos = {(r["actual_status"], r["verification"], r["gpu_name"]) for r in rows}
        return Response({"filters": [{"actual_status": a, "verification": v, "gpu_name": g}
                                     for a, v, g in sorted(combos)]})


class InstanceView(VastView):
    """GET/PUT/DELETE /api/v0/instances/ID/: show; stop, start, label; destroy."""

    api_scope = RENTER_ONLY  # core/api/scopes.py

    def get(self, request, instance_id: int):
        instance = _own_instance(request, instance_id)
        if instance.status == S.DESTROYED:
            return Response({"instances": None})
        return Response({"instances": instance_row(instance)})

    def put(self, request, instance_id: int):
        body = _body(request)
        _refuse_unknown(body, {"state", "label"})
        instance = _own_instance(request, instance_id)
        state = body.get("state")
        if state not in (None, "running", "stopped"):
            raise ValidationFailed(f"`state` is \"running\" or \"stopped\", not {repr(state)[:40]}.",
                                   field="state")
        label = _label(body["label"]) if "label" in body else None
        # One transaction: a refused stop or start (a 409) leaves the label as it was. The jobs they queue are
        # sent on commit. The state first, the label after it: a start locks the node's row, then the instance's,
        # as every writer of both does (a retire, a verification); the label's UPDATE first locked the instance
        # before the node and deadlocked with a retire of its node (found by review: a 500).
        with transaction.atomic():
            # `state` is the one wanted (Vast's PUT is declarative, and the CLI sends it again after a 5xx or a
            # timeout): an instance in it already is a success, as one on its way there is (found by review: a
            # resent start of an instance that had started meanwhile answered 409 and the CLI reported a failure).
            # "stopped" is what `show instance` reports as intended for a stopping, failed or destroying one too
            # (a stop that took effect and then found the VM gone is `failed`): a resent stop of it is a success.
            if state == "stopped" and instance.status not in STOP_DONE:
                try:
                    instance = instance_svc.instance_stop(instance=instance)
                except Conflict:
                    # Changed while this request waited for its row (the first sending's stop, then a failure):
                    # read under that lock, a success if it is now where the stop was going.
                    now = Instance.objects.filter(pk=instance.pk).values_list("status", flat=True).first()
                    if now not in STOP_DONE:
                        raise
            elif state == "running" and instance.status not in START_DONE:
                try:
                    instance = instance_svc.instance_start(instance=instance)
                except Conflict:
                    now = Instance.objects.filter(pk=instance.pk).values_list("status", flat=True).first()
                    if now not in START_DONE:
                        raise
            if label is not None:
                instance_svc.instance_label(instance=instance, label=label)
        return Response({"success": True})

    def delete(self, request, instance_id: int):
        instance = _own_instance(request, instance_id)
        if instance.status != S.DESTROYED:  # destroyed already: the CLI's resent destroy, a success (see put)
            try:
                instance_svc.instance_destroy(instance=instance)
            except Conflict:
                # The first sending may have destroyed it while this one waited for the row (an interrupted
                # instance is destroyed in the request itself): read under that lock, it is, and so a success
                # (found by the second review round).
                if Instance.objects.filter(pk=instance.pk).values_list("status", flat=True).first() != S.DESTROYED:
                    raise
        return Response({"success": True})


# What `create instance` may send, and the value that means "not asked for". Anything else is refused: this
# platform starts a VM or container reached by SSH with the account's keys; `env` (variables and `-p` ports),
# `onstart` and `image_login` are mapped onto the instance's options (_options).
_CREATE_UNSET: dict[str, tuple[Any, str]] = {
    "args": (None, "an args launch (--args)"),
    "price": (None, "interruptible instances (--bid_price)"),
    "extra": (None, "--extra"),
    "python_utf8": (False, "--python-utf8"),
    "lang_utf8": (False, "--lang-utf8"),
    "use_jupyter_lab": (False, "Jupyter"),
    "jupyter_dir": (None, "Jupyter"),
    "template_hash_id": (None, "templates (--template_hash)"),
    "user": (None, "--user"),
    "volume_info": (None, "volumes"),
}
_CREATE_IGNORED = {"client_id", "force", "cancel_unavail", "image", "disk", "label", "runtype"}
_CREATE_MAPPED = {"env", "onstart", "image_login"}
SSH_RUNTYPES = {"ssh", "ssh_proxy", "ssh_direc ssh_proxy", "ssh_direct"}


def _image(name: Any) -> Image | str:
    """A catalogue image (its slug or its exact container or VM image name), else the renter's own reference."""
    if not isinstance(name, str) or not name:
        raise ValidationFailed("Give an image: --image SLUG (see GET /api/v1/images/) or an image reference "
                               "(e.g. ubuntu:24.04).", field="image")
    opts.clean_image_text(name)  # before the lookup: a NUL reaching PostgreSQL is a 500
    image = Image.objects.filter(Q(slug=name) | Q(docker_image=name) | Q(libvirt_image=name), active=True).first()
    return image if image is not None else opts.image_of(name)


_PORT_RE = re.compile(r"-p (?:(?:[0-9]{1,5}):)?([0-9]{1,5})(/tcp)?")


def _split_env(env: Any) -> tuple[dict[str, Any], list[int]]:
    """Vast's `env` (what the CLI's parse_env makes of --env): `-e` variables, `-p [HOST:]CONTAINER[/tcp]` ports
    (the node picks the host port; only the container port is kept). Other docker options are refused."""
    if env is None:
        return {}, []
    if not isinstance(env, dict):
        raise ValidationFailed("`env` is an object (what `--env '-e NAME=value -p 8888:8888'` becomes).", field="env")
    variables, ports = {}, []
    for key, value in env.items():
        if isinstance(key, str) and (key == "-p" or key.startswith("-p ")):
            match = _PORT_RE.fullmatch(key)
            if match is None:
                raise ValidationFailed(f"{key[:40]!r}: only TCP ports map here, as -p [HOST:]CONTAINER (the node "
                                       "picks the host port).", field="env")
            ports.append(int(match[1]))
        # Any other docker option: parse_env keys -v and -n with their value ("-v /a:/b") but -h alone ("-h").
        elif isinstance(key, str) and key.startswith("-"):
            raise ValidationFailed(f"{key[:40]!r}: only -e variables and -p ports are taken from --env here.",
                                   field="env")
        else:
            variables[key] = value
    return variables, ports


def _login(value: Any, image: Image | str) -> dict[str, str] | None:
    """`--login '-u USER -p PASSWORD [REGISTRY]'` as {"username", "password"}: the login is sent to the registry the
    image is pulled from, so a REGISTRY that is not that one is refused (its token would go to another registry)."""
    if value in (None, ""):
        return None
    words = value.split() if isinstance(value, str) else []
    pairs = dict(zip(words[0::2], words[1::2], strict=False)) if len(words) in (4, 5) else {}
    if "-u" not in pairs or "-p" not in pairs:
        raise ValidationFailed("`image_login` is '-u USER -p PASSWORD [REGISTRY]'.", field="image_login")
    if isinstance(image, Image):
        raise ValidationFailed("A catalogue image needs no registry login (--login).", field="image_login")
    pulled_from = opts.image_registry(image)
    if len(words) == 5 and opts.registry_name(words[4]) != pulled_from:
        raise ValidationFailed(f"The login is for {words[4][:100]!r}, but {image[:100]!r} is pulled from "
                               f"{pulled_from!r}: it would be sent there. Name that registry in the image "
                               "reference, or log in to the image's own.", field="image_login")
    return opts.clean_registry_auth({"username": pairs["-u"], "password": pairs["-p"]}, "image_login")


def _options(body: dict[str, Any], image: Image | str) -> opts.InstanceOptions:
    variables, ports = _split_env(body.get("env"))
    auth = _login(body.get("image_login"), image)
    return opts.InstanceOptions(env=opts.clean_env(variables), onstart=opts.clean_onstart(body.get("onstart")),
                                ports=opts.clean_ports(ports, "env"), registry_auth=auth)


def _disk(value: Any) -> int | None:
    if value is None:
        return None
    # An int first: math.isfinite raises OverflowError on one beyond a float's range.
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0 \
            or not (isinstance(value, int) or math.isfinite(value)):
        raise ValidationFailed("`disk` is a number of GB.", field="disk")
    return math.ceil(value)


def _unset(value: Any, unset: Any) -> bool:
    """Whether a create option means "not asked for": by identity and type, so that 0 (`--bid_price 0`, `args: 0`)
    is not taken for False (0 == False in Python)."""
    if value is None or value is unset:
        return True
    if isinstance(value, str | list | dict):
        return not value
    return value is False


# The booking's options a node's runtime may refuse (instances.booking.RUNTIME_REFUSED_OPTIONS), as `create` gives
# them: `-e` and `-p` in --env, --onstart.
_VAST_OPTION_WORDS = {"env": "the -e variables", "ports": "the -p ports", "onstart": "--onstart"}


def _offer_refusal(exc: ApplicationError, ask_id: int, node_id: int, num_gpus: int) -> ApplicationError:
    """The booking's refusals that name the node, a GPU count or the disk, in the terms a vastai user has: the
    offer id they typed (its GPU count is fixed by the id) and `--disk`."""
    if isinstance(exc, DiskDoesNotFit):
        return Conflict(exc.reworded(f"Offer {ask_id}'s machine", "Ask for less disk (--disk), or take another "
                                     "offer from `vastai search offers` (its disk_space is the room left)."),
                        field="disk")
    if isinstance(exc, Conflict):
        # "Offer NODE is not available: ..." (a node unlisted, offline, retired since the search): the booking's
        # offer ids are node ids; the user typed node × 100 + GPUs.
        message = re.sub(rf"\b([Oo])ffer {node_id}\b", rf"\g<1>ffer {ask_id}", exc.message)
        return exc if message == exc.message else Conflict(message, field=exc.field, extra=exc.extra)
    if not isinstance(exc, ValidationFailed):
        return exc
    if exc.extra.get("runtime") and exc.field in _VAST_OPTION_WORDS:  # the node's agent takes no such option
        given = [_VAST_OPTION_WORDS[name] for name in _VAST_OPTION_WORDS if name in exc.errors]
        return ValidationFailed(
            f"Offer {ask_id}'s machine runs virtual machines from cloud images ({exc.extra['runtime']}), which take no "
            f"-e variables, -p ports or --onstart script yet: leave out {' and '.join(given)}, or take an offer whose "
            "runtime is docker (`vastai search offers 'runtime=docker'`).",
            field="onstart" if given == [_VAST_OPTION_WORDS["onstart"]] else "env")
    if exc.field == "disk_gb":  # the image's range: the same words, Vast's field
        return ValidationFailed(exc.message, field="disk")
    if exc.field == "offer":
        return NotFound(f"There is no offer {ask_id}: take an id from `vastai search offers`.", field="id")
    if exc.field == "num_gpus":
        return NotFound(f"There is no offer {ask_id}: its machine has fewer than {num_gpus} GPUs. Take an id from "
                        "`vastai search offers`.", field="id")
    return exc


def _nvlink_refusal(ask_id: int, node_id: int, num_gpus: int, before: offers.NvlinkNow) -> Conflict:
    """The 409 of an offer listed as NVLink whose GPUs could not all be had on one island at the booking (the
    booking's require_nvlink refusal, rolled back), in the terms of the offer the vastai user typed."""
    now = offers.nvlink_now(node_id)  # read again: the booking rolled back
    listed = (f"Offer {ask_id} was listed with bw_nvlink {before.bandwidth:g} GB/s, which only GPUs on one NVLink "
              "island have")
    if now.on_one_island >= num_gpus:  # free in the committed rows: another booking holds them, not committed yet
        return Conflict(f"{listed}, and another booking was taking {num_gpus} of that island's GPUs at the same "
                        f"moment: none was booked across islands. Try again in a moment, or take another offer.",
                        field="id")
    return Conflict(f"{listed}; at most {now.on_one_island} free GPU{'s' if now.on_one_island != 1 else ''} of its "
                    f"machine share an island now (another booking took the rest), so none was booked across "
                    f"islands over PCIe. A search shows it with bw_nvlink 0 now, and booking it again gets GPUs of "
                    f"different islands: take another offer (`vastai search offers 'bw_nvlink>0 "
                    f"num_gpus>={num_gpus}'`).", field="id")


class OfferCreateView(VastView):
    """PUT /api/v0/asks/ID/: `vastai create instance ID --image ... --disk ... --ssh`. A retry of the same create
    answers the instance it made (compat.vast.booking)."""

    api_scope = RENTER_ONLY  # core/api/scopes.py

    def put(self, request, ask_id: int):
        email_verified_required(user=request.user)  # said first: no other fix helps before it
        body = _body(request)
        idempotency_key, _ = idempotency_key_of(request)
        fingerprint = booking.create_fingerprint(ask_id=ask_id, body=body)
        # A retry gets what the first request made, even if its input would not validate now (keys deleted...).
        earlier = booking.ask_replayed(renter=request.user, fingerprint=fingerprint, idempotency_key=idempotency_key)
        if earlier is not None:
            # The CLI prints the whole answer ("Started. {...}"): someone who meant a second identical instance
            # reads why there is one and what to change.
            return Response({"success": True, "new_contract": earlier.pk, "msg": booking.replay_message(
                earlier, idempotency_key=idempotency_key)})
        _refuse_unknown(body, set(_CREATE_UNSET) | _CREATE_IGNORED | _CREATE_MAPPED)
        for name, (unset, what) in _CREATE_UNSET.items():
            if not _unset(body.get(name), unset):
                raise ValidationFailed(f"This platform does not offer {what}: an instance is a VM you reach by SSH.",
                                       field=name)
        runtype = body.get("runtype")
        # isinstance first: a list or an object is no key of the set (a TypeError, a 500).
        if runtype is not None and (not isinstance(runtype, str) or runtype not in SSH_RUNTYPES):
            raise ValidationFailed(f"Only SSH instances (--ssh) are offered, not runtype {repr(runtype)[:40]}.",
                                   field="runtype")
        node_id, num_gpus, generation = offers.offer_of(ask_id)
        image, disk, label = _image(body.get("image")), _disk(body.get("disk")), _label(body.get("label"))
        options = _options(body, image)
        # `create` names no key: every key of the account goes on the instance.
        keys = list(SshKey.objects.filter(user=request.user).order_by("id").values_list("public_key", flat=True))
        if not keys:
            raise ValidationFailed("Your account has no SSH key: add one first (vastai create ssh-key KEY); every "
                                   "key of the account is put on the instance.", field="ssh_key")
        # Vast's search carries the NVLink filter (bw_nvlink), its create nothing of it: an offer listed as NVLink
        # now (bw_nvlink above 0: its GPUs can all be on one island) is booked with require_nvlink, so it gets them
        # on one island or is refused, never across islands (before, a booking that met another's in flight got
        # GPUs of two islands, PCIe between them, from an offer that said NVLink). One query, for 2 GPUs or more.
        nvlink = offers.nvlink_now(node_id) if num_gpus >= 2 else None
        require_nvlink = nvlink is not None and nvlink.listed(num_gpus)
        try:
            instance = booking.ask_book(renter=request.user, fingerprint=fingerprint, idempotency_key=idempotency_key,
                                        ask_id=ask_id, price_generation=generation, node_id=node_id,
                                        num_gpus=num_gpus, image=image, ssh_public_keys=keys, disk_gb=disk,
                                        label=label, options=options, require_nvlink=require_nvlink)
        except booking.AskPriceRaised:
            raise  # already in the offer's terms
        except (ValidationFailed, Conflict) as exc:  # DiskDoesNotFit is a Conflict
            if exc.field == "require_nvlink" and nvlink is not None:
                raise _nvlink_refusal(ask_id, node_id, num_gpus, nvlink) from None
            refusal = _offer_refusal(exc, ask_id, node_id, num_gpus)
            if refusal is exc:
                raise
            raise refusal from None
        answer: dict[str, Any] = {"success": True, "new_contract": instance.pk}
        if nvlink is not None and not require_nvlink and nvlink.bandwidth and nvlink.islands:
            # An offer listed with bw_nvlink 0 (its GPUs on no one island now) books across islands: said, not
            # silent, to someone whose search showed it with NVLink before another booking took part of the island.
            instance.node_nvlink_islands = nvlink.islands  # type: ignore[attr-defined]  # as instances_for_user sets it
            if instance_svc.instance_on_one_nvlink_island(instance=instance) is False:
                answer["msg"] = (f"Instance {instance.pk}'s {num_gpus} GPUs are on different NVLink islands (PCIe "
                                 f"between them): offer {ask_id} is listed with bw_nvlink 0 now, at most "
                                 f"{nvlink.on_one_island} free GPU{'s' if nvlink.on_one_island != 1 else ''} of its "
                                 "machine sharing one. Destroy it if you need NVLink, and take an offer that `vastai "
                                 f"search offers 'bw_nvlink>0 num_gpus>={num_gpus}'` lists.")
        return Response(answer)
