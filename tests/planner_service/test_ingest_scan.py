"""planner_service.ingest.json_scan: JSON text through the Numba number-list pass gives the same
Forest, or the same error (field and message), as the decoded document through the standard
library's decoder (the reference: no scan, every list a Python list)."""
from __future__ import annotations

import copy
import json
import math
import random
import struct

import numpy as np
import pytest

from planner_service.errors import LimitError, ValidationError
from planner_service.ingest import forest_from_json
from planner_service.ingest.json_scan import scan_json


def _outcome(body):
    """Forest arrays, or (field, message) of the error, for a body or a decoded document."""
    try:
        f = forest_from_json(body)
    except (ValidationError, LimitError) as exc:
        return ("error", type(exc).__name__, getattr(exc, "field", ""), exc.message)
    return ("forest", f.batch_id, f.vocab_size, f.tree_ids, f.traj_ids, f.group_ids,
            *(getattr(f, a).tobytes() for a in ("tokens", "seg_parent", "seg_offset", "seg_length", "seg_depth",
                                                 "seg_tree", "traj_seg", "traj_offset", "loss_mask", "advantages",
                                                 "reward", "weight")),
            None if f.old_logprobs is None else f.old_logprobs.tobytes())


def _random_doc(rng: random.Random) -> dict:
    vocab = rng.choice([2, 16, 256, 151_936, 10_000_000])
    trajs = []
    prefix = [rng.randrange(vocab) for _ in range(rng.randint(1, 20))]
    for t in range(rng.randint(1, 6)):
        toks = prefix[: rng.randint(1, len(prefix))] + [rng.randrange(vocab) for _ in range(rng.randint(0, 30))]
        L = len(toks)
        traj = {"id": f"t{t}", "tree_id": rng.choice(["a", "b"]), "tokens": toks,
                "loss_mask": [rng.randint(0, 1) for _ in range(L)],
                "old_logprobs": [_random_float(rng) for _ in range(L)]}
        if rng.random() < 0.5:
            traj["advantage"] = [_random_float(rng) for _ in range(L)]
        else:
            traj["advantage"] = _random_float(rng)
        trajs.append(traj)
    nodes = [{"id": 0, "parent": None, "tokens": [rng.randrange(vocab) for _ in range(rng.randint(1, 9))]}]
    for j in range(1, rng.randint(1, 5)):
        nodes.append({"id": j, "parent": rng.randrange(j), "tokens": [rng.randrange(vocab) for _ in range(rng.randint(1, 9))]})
    depth = {}
    for n in nodes:
        depth[n["id"]] = (depth[n["parent"]] if n["parent"] is not None else 0) + len(n["tokens"])
    tree_trajs = []
    for j, n in enumerate(rng.sample(nodes, rng.randint(1, len(nodes)))):
        tree_trajs.append({"id": f"x{j}", "node": n["id"], "old_logprobs": [_random_float(rng) for _ in range(depth[n["id"]])]})
    return {"batch_id": "scan", "vocab_size": vocab, "trajectories": trajs,
            "trees": [{"id": "tree", "nodes": nodes, "trajectories": tree_trajs}]}


def _random_float(rng: random.Random) -> float:
    kind = rng.random()
    if kind < 0.3:
        return float(np.float32(rng.gauss(0, 3)))  # 17-digit reprs of float32 values
    if kind < 0.5:
        return rng.gauss(0, 1) * 10 ** rng.randint(-45, 38)  # float64 reprs, float32 subnormals and near-overflow
    if kind < 0.6:
        return rng.choice([0.0, -0.0, 1.0, -1.5, 1e-7, 3.4028234663852886e38])
    return round(rng.uniform(-20, 0), rng.randint(0, 6))


_JUNK = [None, True, False, -1, 1 << 70, 1.5, "x", [], [1], [[1]], {}, math.nan, math.inf, -1e40, 2, 256, 10**12, -0.0]


def _texts(doc: dict, rng: random.Random) -> list[str]:
    """Several spellings of one document (separators, indentation, exponents)."""
    compact = json.dumps(doc, separators=(",", ":"))
    out = [compact, json.dumps(doc), json.dumps(doc, indent=1)]
    # exponent and upper-case spellings of the floats
    out.append(compact.replace("e-", "E-").replace("e+", "e"))
    return out


@pytest.mark.parametrize("seed", range(4))
def test_scanned_text_builds_the_decoded_documents_forest_or_error(seed):
    rng = random.Random(seed)
    for case in range(40):
        doc = _random_doc(rng)
        if case % 2:  # corrupt one to three values
            paths = list(_paths(doc))[1:]
            for _ in range(rng.randint(1, 3)):
                *parents, last = rng.choice(paths)
                obj = doc
                try:
                    for k in parents:
                        obj = obj[k]
                    obj[last] = copy.deepcopy(rng.choice(_JUNK))
                except (KeyError, IndexError, TypeError):
                    pass
        want = _outcome(json.loads(json.dumps(doc)))
        for text in _texts(doc, rng):
            assert _outcome(text.encode()) == want, text[:300]


def _paths(obj, prefix=()):
    yield prefix
    children = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for k, v in children:
        yield from _paths(v, prefix + (k,))


def _float_texts(rng: random.Random, n: int) -> list[str]:
    out = []
    for _ in range(n):
        r = rng.random()
        if r < 0.25:
            out.append(repr(float(np.float32(rng.uniform(-30, 30)))))
        elif r < 0.4:
            out.append(repr(rng.gauss(0, 1) * 10 ** rng.randint(-50, 40)))
        elif r < 0.55:  # exactly on a float32 rounding midpoint, and a hair either side
            a = np.float32(rng.uniform(-1e6, 1e6))
            b = np.nextafter(a, np.float32(np.inf))
            mid = (float(a) + float(b)) / 2
            out.append(repr(float(rng.choice([mid, np.nextafter(mid, np.inf), np.nextafter(mid, -np.inf)]))))
        elif r < 0.7:  # long significands
            out.append(f"{rng.choice(['', '-'])}{rng.randint(0, 10**rng.randint(1, 30))}.{rng.randint(0, 10**rng.randint(1, 30))}")
        elif r < 0.85:
            out.append(f"{rng.randint(-99, 99)}e{rng.randint(-60, 40)}")
        else:
            bits = rng.getrandbits(32)
            f = struct.unpack("<f", struct.pack("<I", bits))[0]
            out.append(repr(f) if math.isfinite(f) else "0")
    return out


def test_float_lists_round_like_pythons_float_then_float32():
    rng = random.Random(7)
    texts = _float_texts(rng, 20_000)
    with np.errstate(over="ignore"):
        want = np.array([np.float32(float(t)) for t in texts])
    finite = np.isfinite(want)
    texts = [t for t, ok in zip(texts, finite) if ok]
    body = ('{"old_logprobs": [' + ", ".join(texts) + "]}").encode()
    scan = scan_json(body, 8)
    assert scan.ref_length.tolist() == [len(texts)]
    got = scan.values(0)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got.view(np.uint32), want[finite].view(np.uint32))


@pytest.mark.parametrize("text, kept", [
    ("[1, 2, 3]", [1, 2, 3]), ("[1,2,3]", [1, 2, 3]), ("[ 7 ]", [7]), ("[0]", [0]), ("[-0]", [0]),
    ("[-5, 12345678901]", None), ("[01]", None), ("[1 2]", None), ("[1,,2]", None), ("[1,]", None),
    ("[1.0]", None), ("[1e2]", None), ("[true, 1]", None), ("[2147483647]", [2147483647]),
    ("[2147483648]", None), ("[-2147483648]", [-2147483648]), ("[]", None), ("[NaN]", None),
])
def test_token_lists_are_parsed_only_when_exact(text, kept):
    scan = scan_json(f'{{"tokens": {text}}}'.encode(), 8)
    if kept is None:
        assert scan.ref_length.shape[0] == 0 and scan.skeleton == f'{{"tokens": {text}}}'.encode()
    else:
        assert scan.values(0).tolist() == kept and scan.skeleton == b'{"tokens": "\\u00000"}'


def test_no_list_is_replaced_when_the_text_spells_a_placeholder():
    body = b'{"batch_id": "\\u00000", "tokens": [1, 2]}'
    scan = scan_json(body, 8)
    assert scan.skeleton == body and scan.ref_length.shape[0] == 0


def test_invalid_json_positions_refer_to_the_submitted_text():
    good = {"batch_id": "b", "vocab_size": 9, "trajectories": [{"id": "a", "tokens": [1] * 50}]}
    text = json.dumps(good)
    bad = text[:-2] + ",}" + text[-1]  # a trailing comma in the last object, after the long list
    with pytest.raises(ValidationError) as info:
        forest_from_json(bad.encode())
    pos = bad.index(",}") + 1
    assert f"column {pos + 1} (byte {pos})" in info.value.message, info.value.message
