"""What certified participants and the consistency check cost a device in a secure round.

    python -m benchmarks.secure_identity [--devices 100]

In process, over a round of `--devices` devices with SecAgg+ neighbours (k about 6 log2 n) on a
3,706 x 50 model (the secure aggregation benchmark's), no dropouts. Per device (medians over the
round's devices), it times and sizes:
- the secure round as before: keys, shares and their encryption, the masks, the masked input, the
  unmasking answer (what benchmarks.secure calls the device's extra CPU), and its bytes up
  and down as the device driver counts them (JSON bodies, the raw masked input);
- what the identity adds: signing its advertisement; checking every roster entry's certificate and
  signature and that no key repeats; signing its partner statement and the survivor set; checking
  the signed view (a quorum of the roster's confirmations, every survivor's partner statement:
  secure_aggregation.view); and their bytes (certificates and signatures in the roster, the
  statement and confirmation up, the survivors' confirmations and statements down).
Target (issue 28): at most 20 ms and 10% more bytes per device at 100 devices.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import time

import numpy as np

from enrollment_authority.authority import EnrollmentAuthority
from secure_aggregation import server
from secure_aggregation.config import RoundParameters
from secure_aggregation.device import DeviceSession, round_graph
from secure_aggregation.identity import SignedAdvertisement, SigningKey, verified_roster, verify
from secure_aggregation.messages import (
    ciphertexts_to_json,
    encode_vector,
    shares_to_json,
)
from secure_aggregation.neighbours import suggested_neighbours
from secure_aggregation.quantization import Layout, quantize
from secure_aggregation.view import Confirmation, PartnerStatement, View, check_view

NUM_ITEMS, DIM = 3706, 50
CONTEXT = "bench/1/identity"


def size(document: object) -> int:
    return len(json.dumps(document))


def measure(devices: int) -> dict[str, float]:
    layout = Layout([("item_embeddings", (NUM_ITEMS, DIM))])
    k = suggested_neighbours(devices)
    params = RoundParameters(CONTEXT, layout.length, 32, 1.0, devices, k, 0.4, devices // 2)
    rng = np.random.default_rng(0)
    authority = EnrollmentAuthority()
    indices = list(range(1, devices + 1))
    identities = {i: SigningKey() for i in indices}
    certificates = {i: authority.certify(identities[i].public) for i in indices}
    base: dict[int, float] = dict.fromkeys(indices, 0.0)
    extra: dict[int, float] = dict.fromkeys(indices, 0.0)
    roster_check: dict[int, float] = dict.fromkeys(indices, 0.0)  # part of the extra
    up: dict[int, int] = dict.fromkeys(indices, 0)
    down: dict[int, int] = dict.fromkeys(indices, 0)
    extra_up: dict[int, int] = dict.fromkeys(indices, 0)
    extra_down: dict[int, int] = dict.fromkeys(indices, 0)

    def timed(i: int, into: dict[int, float], work):  # type: ignore[no-untyped-def]
        start = time.process_time()
        out = work()
        into[i] += time.process_time() - start
        return out

    sessions = {i: DeviceSession(params) for i in indices}
    keys = {i: timed(i, base, sessions[i].advertise) for i in indices}
    signed = {
        i: timed(
            i, extra, lambda i=i: SignedAdvertisement.sign(identities[i], certificates[i], CONTEXT, keys[i])
        )
        for i in indices
    }
    bare_roster = {str(i): a.to_json() for i, a in keys.items()}
    signed_roster = {str(i): a.to_json() for i, a in signed.items()}
    for i in indices:
        up[i] += size(keys[i].to_json())
        extra_up[i] += size(signed[i].to_json()) - size(keys[i].to_json())
        down[i] += size(bare_roster)
        extra_down[i] += size(signed_roster) - size(bare_roster)
        verify.cache_clear()  # a phone's own cost: no verdict of another simulated phone's
        timed(i, roster_check, lambda: verified_roster(signed, authority.public_key, CONTEXT, time.time()))
    graph = round_graph(params, indices)
    shares = {}
    for i in indices:
        shares[i] = timed(i, base, lambda i=i: sessions[i].share_keys(i, keys))
        up[i] += size(shares_to_json(shares[i]))
    masked = {}
    for i in indices:
        ciphertexts = server.ciphertexts_for(i, graph, shares)
        down[i] += size(ciphertexts_to_json(ciphertexts))
        vector = quantize(
            layout.flatten({"item_embeddings": rng.normal(0, 0.01, (NUM_ITEMS, DIM))}), params, rng
        )
        masked[i] = timed(i, base, lambda i=i, v=vector, c=ciphertexts: sessions[i].masked_input(v, c))
        up[i] += len(encode_vector(masked[i], params))
    survivors = sorted(masked)
    inputs_sha256 = hashlib.sha256(b"inputs").digest()
    roster_digests = {i: sessions[i].roster_digest for i in indices}
    statements = {
        i: timed(
            i,
            extra,
            lambda i=i: PartnerStatement.sign(
                identities[i], CONTEXT, roster_digests[i], inputs_sha256, sessions[i].missing
            ),
        )
        for i in indices
    }
    confirmations = {
        i: timed(
            i,
            extra,
            lambda i=i: Confirmation.sign(
                identities[i], CONTEXT, roster_digests[i], survivors, inputs_sha256
            ),
        )
        for i in indices
    }
    signing_keys = {i: identities[i].public for i in indices}
    relayed_confirmations = {str(v): confirmations[v].to_json() for v in survivors}
    relayed_statements = {str(v): statements[v].to_json() for v in survivors}
    for i in indices:
        extra_up[i] += size(statements[i].to_json()) + size(confirmations[i].to_json())
        extra_down[i] += size(relayed_confirmations) + size(relayed_statements) + size(survivors)

        def check(i: int = i) -> None:
            # What the device does with what was relayed: parse it, then the signed view's rules.
            view = View(
                params,
                graph,
                roster_digests[i],
                signing_keys,
                i,
                sessions[i].holds,
                inputs_sha256,
                frozenset(survivors),
            )
            check_view(
                view,
                {int(v): Confirmation.from_json(c) for v, c in relayed_confirmations.items()},
                {int(v): PartnerStatement.from_json(c) for v, c in relayed_statements.items()},
            )

        verify.cache_clear()
        timed(i, extra, check)
        answer = timed(i, base, lambda i=i: sessions[i].unmask(survivors))
        up[i] += size(answer.to_json())
    return {
        "neighbours": len(graph[1]),
        "base_ms": 1000 * statistics.median(base.values()),
        "extra_ms": 1000 * statistics.median(extra[i] + roster_check[i] for i in indices),
        "roster_ms": 1000 * statistics.median(roster_check.values()),
        "base_kb": statistics.median(up[i] + down[i] for i in indices) / 1000,
        "extra_kb": statistics.median(extra_up[i] + extra_down[i] for i in indices) / 1000,
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.secure_identity",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--devices", type=int, default=100)
    args = parser.parse_args()
    if args.devices < 4:
        print(f"--devices must be at least 4, got {args.devices}", file=sys.stderr)
        return 2
    r = measure(args.devices)
    print(
        f"{args.devices} devices, {r['neighbours']} neighbours each, {NUM_ITEMS} x {DIM} model "
        "(medians per device):\n"
        f"  secure round: {r['base_ms']:.1f} ms CPU, {r['base_kb']:.0f} KB up + down\n"
        f"  identity and consistency check: +{r['extra_ms']:.1f} ms CPU, +{r['extra_kb']:.1f} KB "
        f"({100 * r['extra_kb'] / r['base_kb']:.1f}% of the bytes); of the CPU, checking the roster's "
        f"{args.devices} certificates and signatures {r['roster_ms']:.1f} ms"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
