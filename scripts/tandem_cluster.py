"""What the benchmark scripts share: a cluster from a cluster.toml text started with
`tandem up` (and stopped), and GETs of its JSON endpoints."""
import contextlib
import http.client
import json
import os
import re
import subprocess
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
# The binary under test (`TANDEM_EXE` names another build, e.g. to compare before and after).
EXE = os.environ.get("TANDEM_EXE") or os.path.join(ROOT, "target", "release", "tandem")


class Router(str):
    """A router's API address (host:port); `.operator` is its operator endpoints' address
    (`/metrics`, `/status.json`, `/debug/workers`: never on the API's port)."""

    def __new__(cls, api, operator):
        r = super().__new__(cls, api)
        r.operator = operator
        return r


def up_addresses(lines):
    """The Router `tandem up` prints: "... behind http://API", then "status page: http://OPS/status"."""
    api = None
    for line in lines:
        if api is None and (m := re.search(r"behind http://(\S+)", line)):
            api = m.group(1)
        elif api and (m := re.search(r"status page: http://([^/\s]+)/status", line)):
            return Router(api, m.group(1))
    raise RuntimeError("tandem up did not come up")


def operator(addr):
    """Where `addr` (a Router, or a plain host:port of the operator) serves its operator endpoints."""
    return getattr(addr, "operator", addr)


@contextlib.contextmanager
def cluster(config, prefix="tandem-bench-"):
    """Starts `tandem up` on `config` (the text of a cluster.toml) in a scratch directory;
    yields (the router's Router address, the directory); stops the cluster on the way out."""
    d = tempfile.mkdtemp(prefix=prefix)
    cfg = os.path.join(d, "cluster.toml")
    with open(cfg, "w") as f:
        f.write(config)
    up = subprocess.Popen([EXE, "up", "--config", cfg], stdout=subprocess.PIPE,
                          stderr=subprocess.DEVNULL, text=True)
    try:
        yield up_addresses(up.stdout), d
    finally:
        up.send_signal(2)
        try:
            up.wait(timeout=15)
        except subprocess.TimeoutExpired:
            up.kill()


def get_json(addr, path):
    """GET `path` (an operator endpoint) from the router at `addr`, parsed."""
    host, port = operator(addr).rsplit(":", 1)
    c = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        c.request("GET", path)
        return json.loads(c.getresponse().read())
    finally:
        c.close()


def metrics(addr):
    """The router's `/metrics` as {series: value} (`addr`: a Router, or its operator address)."""
    host, port = operator(addr).rsplit(":", 1)
    c = http.client.HTTPConnection(host, int(port), timeout=5)
    try:
        c.request("GET", "/metrics")
        text = c.getresponse().read().decode()
    finally:
        c.close()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def worker_stats(addr):
    """Every worker's (name, role, live stats) from `/debug/workers`, by name."""
    ws = get_json(addr, "/debug/workers")["workers"]
    return sorted((w["name"], w["role"], w["stats"]) for w in ws)


# The [router] section of a cluster on loopback ports the OS picks.
ROUTER = '[router]\nlisten = "127.0.0.1:0"\ncontrol = "127.0.0.1:0"\noperator = "127.0.0.1:0"\n'


def decode_stat(m, field):
    """The decode workers' load figure `field` summed, from `/metrics` as `metrics` reads it
    (the router's tandem_worker_<field> gauges)."""
    return sum(v for k, v in m.items() if k.startswith(f"tandem_worker_{field}{{") and 'role="decode"' in k)


def settled(addr, limit=20):
    """`/metrics` once the decode workers hold nothing (heartbeats carry their figures), or
    after `limit` seconds."""
    deadline = time.time() + limit
    while True:
        m = metrics(addr)
        if decode_stat(m, "running") == 0 and decode_stat(m, "kv_blocks_committed") == 0 or time.time() > deadline:
            return m
        time.sleep(0.5)


def colocated(decode_lines):
    """A cluster.toml of one colocated decode worker on loopback ports the OS picks, with
    `decode_lines` added to its [decode] section."""
    return (ROUTER + "[decode]\nreplicas = 1\nthreads = 1\n" + decode_lines)


def pct(xs, p):
    """The `p`-th percentile of `xs` (nearest rank)."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))]
