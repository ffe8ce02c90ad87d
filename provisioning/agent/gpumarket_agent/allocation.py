"""Which VMs hold which GPUs, checked under the node-wide allocate lock immediately before any VM starts; and
whether the cards a VM was given are still where the platform thinks they are.

nvidia-smi numbers the cards anew when one falls off the bus: index 3 may be another card than when the platform
allocated it. A VM's spec keeps the cards' UUIDs beside their indices (`gpu_uuids`, where the platform sent them)
and no VM starts unless each index still carries its UUID (cards_now); VMs are compared as the cards they hold,
not as the numbers those cards had when each VM was recorded (card_ids).

A runtime that hands a running VM's cards to it out of the host's view (Runtime.hides_cards: libvirt binds them to
vfio-pci) leaves nvidia-smi listing only the cards no VM runs on, numbered anew: there a card is judged by its UUID
alone, and one nvidia-smi does not list is held by one of our VMs or gone (cards_held). A running VM's card recorded
without a UUID is not the one nvidia-smi lists at its index now, but the one it was bound to (bound_uuids)."""
from .core import AgentError
from .records import all_records, file_lock
from .smi import read_gpus

NO_DEVICES = "No devices were found"  # nvidia-smi, when every card is bound to another driver
# States of a VM that holds its GPUs: running, or restarting (docker: its command exited and the engine runs it
# again, on the same devices; not running to the platform).
HOLDING = ("running", "restarting")


def holds_gpus(rt, rec):
    """A running VM holds its GPUs; so does one whose create has not finished (recorded, maybe pulling, its
    container not made or not started yet: `provisioning` in its record), until that create ends or the VM is
    destroyed. The platform releases a stopped VM's GPUs to other renters: a stopped VM holds none, and neither
    does a finished record whose container or domain is missing (removed on the node: `docker container prune`,
    an undefined domain). Counted as holding, such a record kept its cards from every later booking (gpu_busy)
    while the platform failed its instance; a create retried for it marks it `provisioning` again."""
    return bool(rec.get("provisioning")) or rt.state(rec) in HOLDING


def cards_now(gpus, indices, uuids=None):
    """The node's GPUs (read_gpus rows) at `indices`, in that order, after checking that each index still carries
    the card the platform allocated (`uuids`, aligned with `indices`; None, or a None entry: judged by index)."""
    at = {g["index"]: g for g in gpus}
    where = {g["uuid"]: g["index"] for g in gpus if g.get("uuid")}
    for index, uuid in zip(indices, uuids or [None] * len(indices)):  # noqa: B905 - python3.8
        if uuid is not None and uuid not in where:
            raise AgentError("gpu_missing", "GPU %s (index %d when it was allocated) is not on this node now "
                                            "(fallen off the bus?)" % (uuid, index))
        if uuid is not None and where[uuid] != index:
            now = ("GPU index %d is now %s, not %s" % (index, at[index].get("uuid") or "a card without a UUID", uuid)
                   if index in at
                   else "there is no GPU index %d now" % index)
            raise AgentError("gpu_moved", "%s: nvidia-smi numbered the cards anew (%s is index %d now)" % (
                now, uuid, where[uuid]))
        if index not in at:
            raise AgentError("gpu_missing", "no GPU with index %d on this node now (fallen off the bus?)" % index)
    return [at[i] for i in indices]


def visible_gpus(rt):
    """The cards the host's nvidia-smi lists now (read_gpus rows). Where the runtime hands a running VM's cards out
    of the host's view, nvidia-smi finds none once every card is handed out: none listed, not a failure."""
    try:
        return read_gpus(rt.cfg)[0]
    except AgentError as exc:
        if rt.hides_cards and exc.code == "command_failed" and NO_DEVICES in exc.message:
            return []
        raise


def cards_held(rt, rec, gpus, others=None):
    """rec's cards now (read_gpus rows, in its spec's index order). Where the host sees every card: cards_now. Where
    the runtime hides a running VM's cards (rt.hides_cards), by UUID wherever nvidia-smi numbers it: a card it does
    not list is held by one of our VMs (`others`, every other record when None: gpu_busy; rec itself, running: its
    row says where it was last seen, rec's `pci_bus_ids`) or gone (gpu_missing). A card without a UUID (a record
    from before gpu_uuids): by index, as before; rec running, by the card it was bound to (bound_uuids), else as
    out of view, address unknown: never the card nvidia-smi lists at that index now."""
    spec = rec["spec"]
    indices, uuids = spec["gpu_indices"], spec.get("gpu_uuids")
    if not rt.hides_cards:
        return cards_now(gpus, indices, uuids)
    running = None in (uuids or [None]) and rt.state(rec) == "running"
    uuids = bound_uuids(rec) if running else uuids
    listed = {g["uuid"]: g for g in gpus if g.get("uuid")}
    cards = []
    for index, uuid in zip(indices, uuids or [None] * len(indices)):  # noqa: B905 - python3.8
        if uuid is None and running:
            cards.append({"index": index, "uuid": None, "pci_bus_id": None})
        elif uuid is None:
            cards += cards_now(gpus, [index])
        elif uuid in listed:
            cards.append(listed[uuid])
        else:
            if others is None:
                others = [r for r in all_records(rt.cfg) if r["vm_id"] != rec["vm_id"]]
            cards.append(held_card(rt, rec, others, index, uuid))
    return cards


def held_card(rt, rec, others, index, uuid):
    """A card of rec's spec that the host's nvidia-smi does not list: another VM of ours holding it makes it busy
    (as check_gpus_free would, were it listed); rec running holds it itself (a retried start or create of a VM that
    runs: present); else it is gone."""
    if any(uuid in bound_uuids(r) and holds_gpus(rt, r) for r in others):
        raise AgentError("gpu_busy", "GPU %d is in use by another running VM" % index)
    if rt.state(rec) in HOLDING:
        return {"index": index, "uuid": uuid, "pci_bus_id": (rec.get("pci_bus_ids") or {}).get(uuid)}
    raise AgentError("gpu_missing", "GPU %s (index %d when it was allocated) is not on this node now "
                                    "(fallen off the bus?)" % (uuid, index))


def bound_uuids(rec):
    """rec's cards' UUIDs, in its spec's index order (None: unknown): as its spec records them, a card recorded
    without one (a record from before gpu_uuids) completed from its `pci_bus_ids` (the cards it was last bound to,
    in that order) where those name one card for each index."""
    spec = rec["spec"]
    uuids = spec.get("gpu_uuids") or [None] * len(spec["gpu_indices"])
    bound = list(rec.get("pci_bus_ids") or ())
    if None in uuids and len(bound) == len(uuids):
        uuids = [u or b for u, b in zip(uuids, bound)]  # noqa: B905 - python3.8
    return uuids


def remember_addresses(rt, rec, cards):
    """Where the runtime hides a running VM's cards, the record keeps each card's PCI address ({UUID: bus id}): the
    card can still be addressed (a domain redefined) while nvidia-smi does not list it."""
    if rt.hides_cards:
        rec["pci_bus_ids"] = {c["uuid"]: c["pci_bus_id"] for c in cards if c.get("uuid") and c.get("pci_bus_id")}


def cards_out_of_view(rt, gpus, records):
    """How many of the node's cards our VMs hold out of the host's view (0 where the host sees every card): those
    of running VMs that nvidia-smi does not list (a record's card without a UUID: a running VM's, counted)."""
    if not rt.hides_cards:
        return 0
    listed = {g.get("uuid") for g in gpus}
    held = set()
    for rec in records:
        if rt.state(rec) == "running":
            spec = rec["spec"]
            pairs = zip(spec["gpu_indices"], spec.get("gpu_uuids") or [None] * len(spec["gpu_indices"]))  # noqa: B905
            held.update(u or (rec["vm_id"], i) for i, u in pairs if u is None or u not in listed)
    return len(held)


def card_ids(indices, uuids, at):
    """{index: the card}: its UUID as recorded, else the UUID at that index now (a record from before gpu_uuids,
    judged by index as then), else the bare index. `at` None (the node's cards unknown): by index alone."""
    uuids = uuids if uuids and at is not None else [None] * len(indices)
    at = at or {}
    return {i: u or at.get(i) or "index %d" % i for i, u in zip(indices, uuids)}  # noqa: B905


def held_ids(rt, rec, at):
    """The cards another VM that holds GPUs holds, named as card_ids names them. Where the runtime hides a running
    VM's cards, nvidia-smi lists none of them: a card its record names without a UUID is the one it was bound to
    (bound_uuids), else one out of view that no listed card is, never the card at that index now."""
    spec = rec["spec"]
    hides = getattr(rt, "hides_cards", False)  # check_gpus_free asks only state() of a runtime otherwise
    if not (hides and at is not None and None in (spec.get("gpu_uuids") or [None])
            and rt.state(rec) == "running"):
        return set(card_ids(spec["gpu_indices"], spec.get("gpu_uuids"), at).values())
    return {u or "GPU %d of running VM %s, out of view" % (i, rec["vm_id"])
            for i, u in zip(spec["gpu_indices"], bound_uuids(rec))}  # noqa: B905 - python3.8


def check_gpus_free(rt, others, indices, mig_uuids=None, uuids=None, gpus=None):
    """A VM given MIG slices holds only those slices of its GPU; a VM given a whole GPU holds it and every slice
    of it. Compared as cards (card_ids, held_ids; with `gpus` the node's GPUs now: without, by index alone)."""
    at = None if gpus is None else {g["index"]: g.get("uuid") for g in gpus}
    holding = [r for r in others if holds_gpus(rt, r)]

    def cards(recs):
        return {c for r in recs for c in held_ids(rt, r, at)}
    whole = cards(r for r in holding if not r["spec"].get("mig_uuids"))
    sliced = cards(r for r in holding if r["spec"].get("mig_uuids"))
    slices = {u for r in holding for u in r["spec"].get("mig_uuids") or ()}
    taken = whole if mig_uuids else whole | sliced
    busy = sorted(i for i, card in card_ids(indices, uuids, at).items() if card in taken)
    if busy:
        raise AgentError("gpu_busy", "GPU %d is in use by another running VM" % busy[0])
    taken = sorted(slices & set(mig_uuids or ()))
    if taken:
        raise AgentError("gpu_busy", "MIG device %s is in use by another running VM" % taken[0])


def check_and_start(rt, rec, gpus=None):
    """The card check, the GPU check and the start, with the allocate lock already held (vm start holds it while
    it rebinds). `gpus`: the node's GPUs as just read (read here when not given)."""
    spec = rec["spec"]
    gpus = visible_gpus(rt) if gpus is None else gpus
    others = [r for r in all_records(rt.cfg) if r["vm_id"] != rec["vm_id"]]
    remember_addresses(rt, rec, cards_held(rt, rec, gpus, others))
    check_gpus_free(rt, others, spec["gpu_indices"], spec.get("mig_uuids"), spec.get("gpu_uuids"), gpus)
    rt.start(rec)


def checked_start(rt, rec):
    """Start a VM only if its cards are where its spec says and no other VM holds them, under the allocate lock:
    every start goes through here (a create's, a retried create's, vm start's), so two VMs never run on one GPU,
    nor one on a card it was not given, whatever the order of calls."""
    with file_lock(rt.cfg, "allocate", timeout=60):
        check_and_start(rt, rec)
