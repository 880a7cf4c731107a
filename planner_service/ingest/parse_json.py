"""Parsing pass over a JSON rollout document (docs/rollouts.md): structure, scalars, ids.

    raw = parse_json(load_document(body, limits), limits)   # RawBatch; a decoded dict skips the scan

`load_document` runs `json_scan.scan_json` and decodes the skeleton (orjson, else the standard
library's decoder for what orjson refuses); one walk in document order then checks shapes,
scalars and ids, counts sizes against the limits and stops at its first problem
(`RawBatch.stop`). Element types and values are `check.check_batch`'s (docs/design/rollout-forest.md).
"""
from __future__ import annotations

import json
import math

from planner_service.errors import ValidationError
from planner_service.ingest.batch import F32_MAX, NODE_FIELDS, RANK, Column, ListRef, RawBatch, Stop, Walk, describe, \
    number_text, printable
from planner_service.ingest.json_scan import ScannedJSON, scan_json
from planner_service.ingest.limits import Limits

_TOP = ("batch_id", "vocab_size", "trajectories", "trees", "policy_version")
_FLAT = ("id", "tree_id", "tokens", "loss_mask", "old_logprobs", "ref_logprobs", "advantage", "reward",
         "group_id", "weight")
_TREE_TRAJ = ("id", "node", "loss_mask", "old_logprobs", "ref_logprobs", "advantage", "reward", "group_id",
              "weight")
_TREE = ("id", "nodes", "trajectories")
_NODE = ("id", "parent", "tokens", *NODE_FIELDS)
_INT64 = (-(1 << 63), (1 << 63) - 1)
_INT32_MAX = (1 << 31) - 1
#: Deepest container nesting accepted in JSON text (a rollout document has 6 levels).
MAX_JSON_DEPTH = 32


def load_document(doc: dict | bytes | bytearray | str, limits: Limits) -> tuple[dict, ScannedJSON | None]:
    """Decode JSON text/bytes (size- and depth-checked) into the document object.

    Returns the document (parsed number lists as placeholder strings) and the scan holding those
    lists; a dict is returned as it is, with no scan.
    """
    scan = None
    if isinstance(doc, (bytes, bytearray, memoryview, str)):
        import orjson  # only JSON text needs it: a decoded dict (in-process planning, GPU images) does not

        limits.check("max_body_bytes", len(doc), "bytes of JSON")
        data = doc.encode("utf-8", "surrogatepass") if isinstance(doc, str) else doc
        scan = scan_json(data, MAX_JSON_DEPTH)
        if scan.depth_error is not None:
            raise _too_deep(scan)
        try:
            if scan.long_int:
                raise orjson.JSONDecodeError("integer literal of >= 19 digits", "", 0)
            doc = orjson.loads(scan.skeleton)
        except orjson.JSONDecodeError:
            try:
                doc = json.loads(scan.skeleton)  # decodes bytes with "surrogatepass", as before
            except json.JSONDecodeError as exc:
                raise ValidationError("", f"expected a JSON document, got invalid JSON ({_where(exc, scan, data)})") from None
            except UnicodeDecodeError:
                # bytes that are not UTF-8 become lone surrogates, so that the walk's text check
                # names the field holding them
                text = bytes(scan.skeleton).decode("utf-8", "surrogateescape")
                try:
                    doc = json.loads(text)
                except json.JSONDecodeError as exc:
                    where = _where(exc, scan, data, errors="surrogateescape")
                    raise ValidationError("", f"expected a JSON document, got invalid JSON ({where})") from None
            except (ValueError, RecursionError) as exc:
                raise ValidationError("", f"expected a JSON document, got invalid JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise ValidationError("", f"expected a JSON object, got {describe(doc)}")
    return doc, scan


def _where(exc: json.JSONDecodeError, scan: ScannedJSON, data, errors: str = "surrogatepass") -> str:
    """The decoder's message with the position in the submitted text (not in the skeleton);
    `errors`: how the skeleton's bytes were decoded."""
    prefix = exc.doc[: exc.pos]
    byte = len(prefix.encode("utf-8", errors)) if isinstance(prefix, str) else exc.pos
    pos = scan.body_offset(byte)
    head = bytes(data[:pos])
    line = head.count(b"\n") + 1
    column = pos - (head.rfind(b"\n") + 1) + 1
    return f"{exc.msg}: line {line} column {column} (byte {pos})"


def _too_deep(scan: ScannedJSON) -> ValidationError:
    """The depth error, naming the deepest member on the path (its value is what nests too deep)."""
    path = scan.depth_error.path
    text, field = "", ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else (f".{printable(part)}" if text else printable(part))
        if isinstance(part, str):
            field = text
    return ValidationError(field, f"expected at most {MAX_JSON_DEPTH} levels of nesting, got deeper at "
                                  f"{text or 'the top level'}[...] (byte {scan.depth_error.offset})")


def parse_json(loaded: tuple[dict, ScannedJSON | None] | dict, limits: Limits) -> RawBatch:
    """One parsing pass over a decoded document (`load_document`'s result), in document order."""
    doc, scan = loaded if isinstance(loaded, tuple) else (loaded, None)
    raw = RawBatch(source="json", lists=scan)
    for name in ("loss_mask", "old_logprobs", "ref_logprobs", "advantage"):
        raw.columns[name] = Column(name, "mask" if name == "loss_mask" else "float")
    raw.columns["tokens"] = Column("tokens", "token")
    return _Walk(raw, limits).parse(doc)


class _Walk(Walk):

    # -- scalars -------------------------------------------------------------------------------
    def value(self, obj: dict, name: str):
        """obj[name] (None when absent), a parsed number list as its `ListRef`."""
        value = obj.get(name)
        if isinstance(value, str) and self.raw.lists is not None:
            k = self.raw.lists.placeholder(value)
            if k is not None:
                return ListRef(k, int(self.raw.lists.ref_length[k]))
        return value

    def string(self, obj: dict, name: str, key: tuple, path: str, *, required: bool) -> str:
        value = obj.get(name)
        field = f"{path}.{name}" if path else name
        if value is None:
            if required:
                raise Stop(key, field, "expected a non-empty string, got nothing")
            return ""
        if not isinstance(value, str) or (required and not value):
            raise Stop(key, field, f"expected a {'non-empty ' if required else ''}string, got {describe(value)}")
        if len(value) > self.limits.max_id_length:
            raise Stop(key, field, f"expected at most {self.limits.max_id_length} characters (Limits.max_id_length), got {len(value)}")
        self.unicode(value, key, field)
        return value

    def number(self, obj: dict, name: str, key: tuple, path: str, default: float | None,
               expect: str = "a number") -> float | None:
        value = obj.get(name)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise Stop(key, f"{path}.{name}", f"expected {expect}, got {describe(value)}")
        try:
            value = float(value)
        except OverflowError:  # an integer literal beyond float64
            raise Stop(key, f"{path}.{name}", f"expected a finite float32, got {describe(value)}") from None
        if not math.isfinite(value) or abs(value) > F32_MAX:
            raise Stop(key, f"{path}.{name}", f"expected a finite float32, got {value!r}")
        return value

    def integer(self, value, key: tuple, field: str, lo: int, hi: int) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise Stop(key, field, f"expected an integer, got {describe(value)}")
        if not lo <= value <= hi:
            raise Stop(key, field, f"expected an integer in [{lo}, {hi}], got {number_text(value)}")
        return value

    def array(self, obj: dict, name: str, key: tuple, path: str) -> list | ListRef | None:
        value = self.value(obj, name)
        if value is None:
            return None
        if not isinstance(value, (list, ListRef)):
            raise Stop(key + (RANK[name],), f"{path}.{name}", f"expected a list, got {describe(value)}")
        return value

    def unknown(self, obj: dict, allowed: tuple, key: tuple, path: str) -> None:
        for name in obj:
            if name not in allowed:
                shown = printable(name)
                raise Stop(key + (99,), f"{path}.{shown}" if path else shown,
                           f"expected one of the fields {', '.join(allowed)}, got unknown field {name!r}")

    def unicode(self, value: str, key: tuple, field: str) -> None:
        """Reject strings that are not valid Unicode text (a lone surrogate from a \\udXXX escape)."""
        if value.isascii():
            return
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            ch = value[exc.start]
            got = f"a lone surrogate {ch!r}"
            if 0xDC80 <= ord(ch) <= 0xDCFF:  # how load_document decodes bytes that are not UTF-8
                got += f" (or the byte 0x{ord(ch) - 0xDC00:02x}, which is not UTF-8)"
            raise Stop(key, field, f"expected valid UTF-8 text, got {got} at character {exc.start}") from None

    # -- document --------------------------------------------------------------------------------
    def run(self, doc: dict) -> None:
        raw = self.raw
        raw.batch_id = self.string(doc, "batch_id", (0,), "", required=True)
        raw.vocab_size = self.integer(doc.get("vocab_size"), (1,), "vocab_size", 1, _INT32_MAX)
        if doc.get("policy_version") is not None:
            raw.policy_version = self.integer(doc["policy_version"], (1, 1), "policy_version", 0, _INT64[1])
        trajectories = doc.get("trajectories") or []
        trees = doc.get("trees") or []
        for name, value in (("trajectories", trajectories), ("trees", trees)):
            if not isinstance(value, list):
                raise Stop((_TOP.index(name),), name, f"expected a list, got {describe(value)}")
        self.limits.check("max_trajectories", len(trajectories), "trajectories", "trajectories")
        self.limits.check("max_trees", len(trees), "trees", "trees")
        for j, traj in enumerate(trajectories):
            self.flat_trajectory(j, traj)
        for k, tree in enumerate(trees):
            self.tree(k, tree)
        self.unknown(doc, _TOP, (4,), "")
        if not raw.traj_ids:
            raise Stop((5,), "trajectories", "expected at least one trajectory (flat or in a tree), got none")

    def common(self, obj: dict, g_key: tuple, path: str, length: int | None,
               node_fields: frozenset[str] | None = None) -> None:
        """Fields shared by flat and explicit-tree trajectories, after id/tokens/node
        (`node_fields`: what the trajectory's tree carries on its nodes)."""
        raw = self.raw
        g = len(raw.traj_ids) - 1
        mask = self.array(obj, "loss_mask", g_key, path)
        self.tree_field_clash("loss_mask", mask is not None, node_fields, g_key, path)
        if mask is not None:
            self.per_position("loss_mask", mask, g, g_key, path, length)
        for name in ("old_logprobs", "ref_logprobs"):
            values = self.array(obj, name, g_key, path)
            has = self.tree_field_clash(name, values is not None, node_fields, g_key, path)
            first = self.presence.setdefault(name, (has, path))
            if first[0] != has:
                raise Stop(g_key + (RANK[name],), f"{path}.{name}",
                           f"expected {name} on every trajectory or on none ({first[1]} "
                           f"{'has' if first[0] else 'has none'}), got "
                           f"{'a list' if values is not None else 'values on its tree nodes' if has else 'none'}")
            if values is not None:
                self.per_position(name, values, g, g_key, path, length)
        adv = self.value(obj, "advantage")
        if isinstance(adv, (list, ListRef)):
            self.per_position("advantage", adv, g, g_key, path, length)
            raw.adv_scalar.append(0.0)
        else:
            raw.adv_scalar.append(self.number(obj, "advantage", g_key + (RANK["advantage"],), path, 0.0,
                                              "a number or a list of numbers (one per token)"))
        raw.reward.append(self.number(obj, "reward", g_key + (RANK["reward"],), path, 0.0))
        raw.group_ids.append(self.string(obj, "group_id", g_key + (RANK["group_id"],), path, required=False))
        weight = self.number(obj, "weight", g_key + (RANK["weight"],), path, None)
        if weight is not None and weight < 0:
            raise Stop(g_key + (RANK["weight"],), f"{path}.weight", f"expected a weight >= 0, got {weight!r}")
        raw.weight.append(weight)

    def per_position(self, name: str, values: list | ListRef, g: int, g_key: tuple, path: str, length: int | None) -> None:
        if length is not None and len(values) != length:
            raise Stop(g_key + (RANK[name],), f"{path}.{name}",
                       f"expected {length} values (one per token), got {len(values)}")
        col = self.raw.columns[name]
        col.owners.append(g)
        col.raw.append(values)

    def trajectory_id(self, obj, key: tuple, path: str) -> None:
        if not isinstance(obj, dict):
            raise Stop(key, path, f"expected an object, got {describe(obj)}")
        self.add_trajectory_id(self.string(obj, "id", key + (0,), path, required=True), key + (0,), path)

    def flat_trajectory(self, j: int, obj) -> None:
        raw = self.raw
        key, path = (2, j), f"trajectories[{j}]"
        self.trajectory_id(obj, key, path)
        raw.traj_tree.append(-1)
        raw.traj_index.append(j)
        raw.flat_tree_name.append(self.string(obj, "tree_id", key + (1,), path, required=False))
        tokens = self.array(obj, "tokens", key, path)
        if not tokens:
            raise Stop(key + (2,), f"{path}.tokens", f"expected a list of at least one token id, got {describe(tokens)}")
        self.limits.check("max_trajectory_length", len(tokens), "tokens in one trajectory", f"{path}.tokens")
        self.total_tokens += len(tokens)
        self.limits.check("max_tokens", self.total_tokens, "expanded tokens", f"{path}.tokens")
        col = raw.columns["tokens"]
        col.owners.append(len(raw.traj_ids) - 1)
        col.raw.append(tokens)
        self.common(obj, key, path, len(tokens))
        self.unknown(obj, _FLAT, key, path)

    def tree(self, k: int, obj) -> None:
        raw = self.raw
        key, path = (3, k), f"trees[{k}]"
        if not isinstance(obj, dict):
            raise Stop(key, path, f"expected an object, got {describe(obj)}")
        tid = self.string(obj, "id", key + (0,), path, required=True)
        raw.tree_ids.append(tid)  # uniqueness: check.py
        nodes = obj.get("nodes")
        if not isinstance(nodes, list) or not nodes:
            raise Stop(key + (1,), f"{path}.nodes", f"expected a list of at least one node, got {describe(nodes)}")
        for j, node in enumerate(nodes):
            self.node(k, j, node)
        raw.trees_complete = k + 1
        node_fields = self.end_nodes(k)
        trajs = obj.get("trajectories") or []
        if not isinstance(trajs, list):
            raise Stop(key + (2,), f"{path}.trajectories", f"expected a list, got {describe(trajs)}")
        for j, traj in enumerate(trajs):
            tkey, tpath = (3, k, 2, j), f"{path}.trajectories[{j}]"
            self.trajectory_id(traj, tkey, tpath)
            raw.traj_tree.append(k)
            raw.traj_index.append(j)
            raw.traj_node_id.append(self.integer(traj.get("node"), tkey + (2,), f"{tpath}.node", *_INT64))
            self.common(traj, tkey, tpath, None, node_fields)
            self.unknown(traj, _TREE_TRAJ, tkey, tpath)
        self.unknown(obj, _TREE, key, path)

    def node(self, k: int, j: int, obj) -> None:
        raw = self.raw
        key, path = (3, k, 1, j), f"trees[{k}].nodes[{j}]"
        if not isinstance(obj, dict):
            raise Stop(key, path, f"expected an object, got {describe(obj)}")
        nid = self.integer(obj.get("id"), key + (0,), f"{path}.id", *_INT64)
        parent = obj.get("parent")
        if parent is not None:
            parent = self.integer(parent, key + (1,), f"{path}.parent", *_INT64)
        tokens = self.array(obj, "tokens", key, path)
        if not tokens:
            raise Stop(key + (2,), f"{path}.tokens", f"expected a list of at least one token id, got {describe(tokens)}")
        self.total_nodes += 1
        self.limits.check("max_nodes", self.total_nodes, "tree nodes", path)
        self.total_node_tokens += len(tokens)
        self.limits.check("max_node_tokens", self.total_node_tokens, "tree-node tokens", f"{path}.tokens")
        raw.node_tree.append(k)
        raw.node_index.append(j)
        raw.node_id.append(nid)
        raw.node_parent.append(parent)
        raw.node_tokens.owners.append(len(raw.node_id) - 1)
        raw.node_tokens.raw.append(tokens)
        for name in NODE_FIELDS:
            values = self.array(obj, name, key, path)
            self.node_field(k, j, name, values is not None, key, path)
            if values is not None:
                if len(values) != len(tokens):
                    raise Stop(key + (RANK[name],), f"{path}.{name}",
                               f"expected {len(tokens)} values (one per token of the node), got {len(values)}")
                col = raw.node_columns[name]
                col.owners.append(len(raw.node_id) - 1)
                col.raw.append(values)
        self.unknown(obj, _NODE, key, path)
