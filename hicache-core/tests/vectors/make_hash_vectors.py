#!/usr/bin/env python3
"""Computes the expected page hashes of tests/hash_vectors.rs with Python's hashlib, written
independently of the Rust code from the format description (hicache-core/src/hash.rs module
docs: SGLang's chain step and the namespace framing). Run: python3 make_hash_vectors.py
"""
import hashlib
import struct


def step(prior_hex, tokens):
    h = hashlib.sha256()
    if prior_hex is not None:
        h.update(bytes.fromhex(prior_hex))
    for t in tokens:
        h.update(struct.pack("<I", t))
    return h.hexdigest()


def chain(prior_hex, tokens, ps):
    out = []
    for i in range(0, len(tokens) - len(tokens) % ps, ps):
        prior_hex = step(prior_hex, tokens[i:i + ps])
        out.append(prior_hex)
    return out


def b(v):
    return b"b" + bytes([v])


def u(v):
    return b"u" + struct.pack("<I", v)


def s(v):
    if v is None:
        return b"n"
    if isinstance(v, str):
        v = v.encode()
    return b"s" + struct.pack("<I", len(v)) + v


def namespace_digest(model, dtype_tag, layout_tag, mha, layers, ps, tp, tps, pp, pps, version=1):
    data = b"hicache-rs/namespace\0" + u(version) + s(model) + b(dtype_tag) + b(layout_tag)
    if mha is not None:
        data += b(1) + u(mha[0]) + u(mha[1])
    data += u(layers) + u(ps) + u(tp) + u(tps) + u(pp) + u(pps)
    return hashlib.sha256(data).digest()


def seed(ns_digest, extra_key, salt):
    return hashlib.sha256(b"hicache-rs/chain-seed\0" + s(ns_digest) + s(extra_key) + s(salt)).hexdigest()


print("empty", step(None, []))
print("one_page_1234", step(None, [1, 2, 3, 4]))
print("max_token", step(None, [0xFFFFFFFF, 0, 7]))
print("prior_chain", chain("00" * 31 + "01", list(range(10)), 4))
print("sglang_chain_ps2", chain(None, [5, 6, 7, 8, 9], 2))
# llama-3-8b@abc, bf16 (3), page_first (2), MHA 8x128, 32 layers, page 4, single rank.
d = namespace_digest("llama-3-8b@abc", 3, 2, (8, 128), 32, 4, 0, 1, 0, 1)
print("ns_digest", d.hex())
sd = seed(d, None, None)
print("seed_plain", sd)
print("seed_lora_salt", seed(d, "lora-a", "tenant-7"))
print("namespaced_chain", chain(sd, list(range(8)), 4))
