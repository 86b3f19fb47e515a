#!/usr/bin/env python3
"""Builds Fuzz/corpus/TARGET/ (the seed inputs of each fuzz target) from Fuzz/seed-store, the
store the real daemon wrote (Fuzz/make-seed-store.sh), and from lines of the control protocol
as docs/SPEC names them. Run by make-seed-store.sh; inputs found by fuzzing (crashes fixed)
are added beside these by hand and kept."""
import hashlib, json, os, struct, sys

root = os.path.join(os.path.dirname(os.path.abspath(__file__)))
store = os.path.join(root, "seed-store")
corpus = os.path.join(root, "corpus")


def add(target, data, name=None):
    d = os.path.join(corpus, target)
    os.makedirs(d, exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    name = name or "seed-" + hashlib.sha1(data).hexdigest()[:16]
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


def read(path):
    with open(path, "rb") as f:
        return f.read()


data = os.path.join(store, "data")
docs = sorted(n for n in os.listdir(data) if not n.startswith(".") and os.path.isdir(os.path.join(data, n)))[0]
regular = []
for folder in (data, os.path.join(data, docs)):
    for n in sorted(os.listdir(folder)):
        p = os.path.join(folder, n)
        add("names", n)
        if os.path.islink(p):
            add("names", os.readlink(p))
        elif os.path.isfile(p) and n == ".kbfs-dir":
            add("dir-meta", read(p))
        elif os.path.isfile(p) and n.endswith(".name"):
            add("names", read(p))
        elif os.path.isfile(p):
            add("conflict-copy", n + ".sync-conflict-20261128-101010-ABCDEFG")
            add("conflict-copy", "report.sync-conflict-20261128-101010-ABCDEFG.txt")
            if folder != data:
                regular.append(read(p))
for b in regular:
    add("file-header", b[:320])
    add("file-content", b)
    add("store-check", b)
for n in sorted(os.listdir(os.path.join(store, "xattrs"))):
    add("xattrs", read(os.path.join(store, "xattrs", n)))
for n in sorted(os.listdir(os.path.join(store, "targets"))):
    add("names", read(os.path.join(store, "targets", n)))

# Keybags: every device's, and the first device's as each older format would state it.
keybags = [read(os.path.join(store, "keybag"))]
keybags += [read(os.path.join(store, "devices", n)) for n in sorted(os.listdir(os.path.join(store, "devices")))
            if n.endswith(".keybag")]
for kb in keybags:
    add("keybag", kb)
first = json.loads(keybags[0])
for fmt in (1, 2, 3):
    old = dict(first, format=fmt)
    if fmt < 4:
        old.pop("settingsMAC", None)
    if fmt < 2:
        old.pop("counterMAC", None)
        old.pop("cipherMAC", None)
    add("keybag", json.dumps(old, indent=2, sort_keys=True))

# The devices folder as one input: (name index in the sorted folder, u16 length, contents).
dev = os.path.join(store, "devices")
names = sorted(os.listdir(dev))
whole = b""
for i, n in enumerate(names):
    c = read(os.path.join(dev, n))
    one = bytes([i]) + struct.pack("<H", len(c)) + c
    add("device-trust", one)
    whole += one
add("device-trust", whole)

# Pairing files: the shapes `device add --approval` and `device approve` write.
sid, did = first["storeID"], first["deviceID"]
add("pairing", json.dumps({"storeID": sid, "deviceID": did, "box": "A" * 43 + "=", "sign": "B" * 43 + "=",
                           "name": "new", "commit": "C" * 43 + "="}))
add("pairing", json.dumps({"deviceID": did, "approver": did, "approverSign": "B" * 43 + "=",
                           "nonce": "D" * 43 + "=", "request": "E" * 43 + "="}))
add("pairing", json.dumps({"deviceID": did, "nonce": "D" * 43 + "="}))

# A TPM enrollment record as `tpm2 enroll` writes it (blobs shortened).
add("tpm-enrollment", json.dumps({"format": 1, "tcti": "swtpm:host=127.0.0.1,port=2321", "objects": {
    "0": {"publicBlob": "AAEACwAG", "privateBlob": "AAIA", "bound": 1}}, "nvIndex": 25165824,
    "epochIndex": 25165825, "primaryName": "000b" + "ab" * 32, "pcrs": [7]}, indent=2))

# The journal: a raw superblock region, and record programs (JournalProgram's grammar).
add("journal", b"\x01KBJS\x02\x00\x00\x00" + struct.pack("<QQQ", 65536, 0, 1) + bytes(64 + 416))
for prog in (b"\x00\x02\x00\x00\x00" + b"\x01\x00\x10\x00\x10\x00" + b"x" * 16,
             b"\x00\x01\x05\x10\x00\x00" + b"\x02\x01\x00\x00\x20\x00" + b"y" * 32 + b"\x03\x01\x00\x00\x00\x00",
             b"\x00\x00\x01\xf0\x00\x00" + b"\x09\x02\x00\x00\x00\x10" + b"z" * 4096):
    add("journal", prog)

# The control protocol, both ways (docs/SPEC: one JSON object per line).
for line in ('{"op":"status"}', '{"op":"subscribe"}', '{"op":"policy"}', '{"op":"unlock","passcode":"p"}',
             '{"op":"lock"}', '{"op":"lock","grace":5}', '{"op":"passwd","old":"a","new":"b"}',
             '{"op":"unlock","passcode":"\\u00e9\\"\\\\"}'):
    add("control-request", line + "\n")
status = read(os.path.join(root, "seed-extra", "status.json"))
add("control-reply", status)
for line in ('{"ok":true,"state":"locked"}', '{"ok":true}',
             '{"ok":false,"error":"throttled","message":"wait","retryAfter":3}',
             '{"event":"willBecomeUnavailable","state":"locking","time":"2026-11-28T10:10:10.000Z"}',
             '36 25 0:45 / /home/u/Private rw,nosuid,nodev - fuse.keybagfs /home/u/.store rw,user_id=0\n'):
    add("control-reply", line)
add("recovery-key", read(os.path.join(root, "seed-extra", "recovery-key")))
print("corpus:", {t: len(os.listdir(os.path.join(corpus, t))) for t in sorted(os.listdir(corpus))})
