"""Secure aggregation (Bonawitz et al., CCS 2017) with SecAgg+ neighbourhoods (Bell et al., CCS 2020).

Pure: numpy and `cryptography` only, no HTTP, database or TensorFlow, so that the device runtime and
the orchestrator share one implementation. A round, with the sets named as in the paper:

1. advertise keys (U1): each device sends two X25519 public keys (one to encrypt shares, one for
   pairwise masks) and a commitment to its self-mask seed;
2. share keys (U2): the server announces U1; each device splits its self-mask seed and its mask
   private key into Shamir shares, one per neighbour in the round's neighbour graph, and encrypts
   each to that neighbour (the server only routes ciphertexts);
3. masked input (U3): each device sends its clipped, quantized update plus its self mask plus one
   pairwise mask per neighbour in U2 (added or subtracted by index order, so pairs cancel in a sum);
4. unmasking (U4): the server announces U3; each device returns shares of its dropped neighbours'
   (U2 minus U3) mask keys and of its surviving neighbours' self-mask seeds, never both for one
   device. The server reconstructs the secrets, regenerates the masks that did not cancel, and
   removes them from the sum of the masked inputs. It learns that sum and nothing else.

Modules: `config` (round parameters), `quantization`, `shamir`, `crypto` (key agreement,
encryption, commitments), `masks` (the mask generator), `neighbours` (the SecAgg+ graph), `device`
(a device's per-phase state) and `server` (the server's pure side).
"""
