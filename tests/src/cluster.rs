//! A real cluster for tests: the `tandem` binary started as router and worker processes on
//! loopback ports chosen by the OS, and HTTP through reqwest's blocking client (a server-sent
//! event stream can be read event by event and dropped mid-way).

use std::io::{BufRead, BufReader, Read};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::Value;

use crate::wait_until;

/// A started cluster; every process is killed when it drops.
pub struct Cluster {
    exe: PathBuf,
    dir: PathBuf,
    config: PathBuf,
    /// The router's HTTP address (the API, `/health`).
    pub http: SocketAddr,
    /// The router's control endpoint.
    pub control: String,
    /// The router's operator address (`/metrics`, `/status*`, `/debug/workers`, ...).
    pub operator: SocketAddr,
    router: Child,
    workers: Vec<(String, Child)>,
    env: Vec<(String, String)>,
}

/// A fresh scratch directory for one cluster.
fn scratch_dir() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tandem-test-{}-{}", std::process::id(), unique()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A cluster to start: the default model (blocks of 16 tokens) on loopback ports chosen by the
/// OS, `prefill` + `decode` workers (no prefill pool with none), small pools — each part
/// changed by its method: `Cluster::of(1, 2).kv("prefer = [\"tcp\"]").start(exe)`.
#[derive(Debug, Clone)]
pub struct Spec {
    prefill: usize,
    decode: usize,
    model: PathBuf,
    block_size: u32,
    decode_blocks: u32,
    kv: String,
    pools: [String; 2],
    router: String,
    env: Vec<(String, String)>,
    toml: Option<String>,
}

impl Spec {
    /// Blocks of `n` tokens.
    pub fn block_size(mut self, n: u32) -> Spec {
        self.block_size = n;
        self
    }

    /// `n` KV blocks per decode worker (512 by default).
    pub fn decode_blocks(mut self, n: u32) -> Spec {
        self.decode_blocks = n;
        self
    }

    /// Lines for the `[kv_transfer]` section (e.g. `prefer = ["tcp"]`).
    pub fn kv(mut self, lines: &str) -> Spec {
        self.kv = lines.into();
        self
    }

    /// Lines for the prefill and the decode pool's sections (e.g. `device = "cuda:0"`).
    pub fn pools(mut self, [prefill, decode]: [&str; 2]) -> Spec {
        self.pools = [prefill.into(), decode.into()];
        self
    }

    /// Lines for the `[router]` section (e.g. `local_prefill_max_tokens = 64`).
    pub fn router(mut self, lines: &str) -> Spec {
        self.router = lines.into();
        self
    }

    /// Environment variables for every process of the cluster.
    pub fn env(mut self, env: &[(String, String)]) -> Spec {
        self.env = env.to_vec();
        self
    }

    /// The model at `path` instead of the default one.
    pub fn model(mut self, path: &Path) -> Spec {
        self.model = path.into();
        self
    }

    /// The whole cluster.toml but its `[model]` section, instead of the one built from the
    /// parts above.
    pub fn toml(mut self, text: &str) -> Spec {
        self.toml = Some(text.into());
        self
    }

    /// The cluster.toml's text.
    fn text(&self) -> String {
        let (model, bs) = (&self.model, self.block_size);
        let head = format!("[model]\npath = {model:?}\nblock_size = {bs}\n\n");
        if let Some(t) = &self.toml {
            return head + t;
        }
        let [prefill_lines, decode_lines] = &self.pools;
        let prefill = match self.prefill {
            0 => String::new(),
            _ => format!(
                "[prefill]\nthreads = 1\nkv_blocks = 256\nmax_batch_tokens = 256\n{prefill_lines}\n"
            ),
        };
        let (router, kv, blocks) = (&self.router, &self.kv, self.decode_blocks);
        head + &format!(
            "[router]\nlisten = \"127.0.0.1:0\"\ncontrol = \"127.0.0.1:0\"\noperator = \"127.0.0.1:0\"\n{router}\n\n{prefill}\n[decode]\nthreads = 1\nkv_blocks = {blocks}\nmax_batch_tokens = 256\n{decode_lines}\n\n[kv_transfer]\n{kv}\n"
        )
    }

    /// Writes the cluster.toml into `dir` (under a name of its own); its path.
    pub fn write(&self, dir: &Path) -> PathBuf {
        let path = dir.join(format!("cluster-{}.toml", unique()));
        std::fs::write(&path, self.text()).expect("write cluster.toml");
        path
    }

    /// Starts the router and the workers, and waits until all have joined.
    pub fn start(self, exe: &Path) -> Cluster {
        let dir = scratch_dir();
        let cfg = self.write(&dir);
        Cluster::start_config(exe, dir, cfg, &self)
    }
}

impl Cluster {
    /// A cluster of `prefill` + `decode` workers to configure and start (see [`Spec`]).
    pub fn of(prefill: usize, decode: usize) -> Spec {
        Spec {
            prefill,
            decode,
            model: crate::model_path(),
            block_size: 16,
            decode_blocks: 512,
            kv: String::new(),
            pools: Default::default(),
            router: String::new(),
            env: Vec::new(),
            toml: None,
        }
    }

    /// `Cluster::of(prefill, decode).start(exe)`: the default cluster.
    pub fn start(exe: &Path, prefill: usize, decode: usize) -> Cluster {
        Cluster::of(prefill, decode).start(exe)
    }

    fn start_config(exe: &Path, dir: PathBuf, cfg: PathBuf, spec: &Spec) -> Cluster {
        let (prefill, decode, env) = (spec.prefill, spec.decode, &spec.env);
        let mut router = Command::new(exe)
            .envs(env.iter().cloned())
            .args(["router", "--config"])
            .arg(&cfg)
            .stdin(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start router");
        let mut lines = BufReader::new(router.stderr.take().unwrap()).lines();
        let at = loop {
            let line = lines
                .next()
                .expect("router printed its address")
                .expect("router output");
            if let Some(at) = router_line(&line) {
                break at;
            }
        };
        // Keep draining the router's log so it never blocks on a full pipe.
        std::thread::spawn(move || for _ in lines {});
        let mut c = Cluster {
            exe: exe.into(),
            dir,
            config: cfg.clone(),
            http: at.http,
            control: format!("http://{}", at.control),
            operator: at.operator,
            router,
            workers: Vec::new(),
            env: env.to_vec(),
        };
        for i in 0..prefill {
            c.add_worker("prefill", &format!("prefill-{i}"), &cfg);
        }
        for i in 0..decode {
            c.add_worker("decode", &format!("decode-{i}"), &cfg);
        }
        c.wait_for(prefill, decode);
        c
    }

    /// A config file for more workers of this cluster's kind: `spec` written into its
    /// scratch directory.
    pub fn config(&self, spec: &Spec) -> PathBuf {
        spec.write(&self.dir)
    }

    /// The scratch directory of this cluster.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The cluster.toml the cluster was started with (for more workers of the same kind).
    pub fn config_file(&self) -> &Path {
        &self.config
    }

    /// Starts one more worker of `role` with `config`.
    pub fn add_worker(&mut self, role: &str, name: &str, config: &Path) {
        let child = self.spawn_worker(role, name, config);
        self.workers.push((name.into(), child));
    }

    /// The process id of the worker named `name`.
    pub fn pid(&self, name: &str) -> Option<u32> {
        self.workers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, c)| c.id())
    }

    /// Starts a worker process without tracking it (the caller owns it).
    pub fn spawn_worker(&self, role: &str, name: &str, config: &Path) -> Child {
        self.spawn_worker_with(role, name, config, &[])
    }

    /// [`Cluster::spawn_worker`] with extra command-line arguments.
    pub fn spawn_worker_with(
        &self,
        role: &str,
        name: &str,
        config: &Path,
        extra: &[&str],
    ) -> Child {
        // A worker given a missing file exits at once, and a test would wait for it to join.
        assert!(config.is_file(), "no config file {}", config.display());
        Command::new(&self.exe)
            .envs(self.env.iter().cloned())
            .args([role, "--router", &self.control, "--name", name])
            .args(extra)
            .arg("--config")
            .arg(config)
            .stdin(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start worker")
    }

    /// Tracks a worker process started by the caller (killed when the cluster drops).
    pub fn adopt(&mut self, name: &str, child: Child) {
        self.workers.push((name.into(), child));
    }

    /// Kills a worker with SIGKILL.
    pub fn kill_worker(&mut self, name: &str) {
        let i = self
            .workers
            .iter()
            .position(|(n, _)| n == name)
            .expect("worker exists");
        let (_, mut c) = self.workers.remove(i);
        c.kill().unwrap();
        c.wait().unwrap();
    }

    /// Waits, at most `limit`, for a worker process to end by itself (e.g. drained after
    /// `SIGTERM`); its exit status. Panics past the limit.
    pub fn wait_exit(&mut self, name: &str, limit: Duration) -> std::process::ExitStatus {
        let i = self
            .workers
            .iter()
            .position(|(n, _)| n == name)
            .expect("worker exists");
        let mut status = None;
        crate::wait_until(&format!("{name} exits"), limit, || {
            status = self.workers[i].1.try_wait().expect("try_wait");
            status.is_some()
        });
        self.workers.remove(i);
        status.expect("exited")
    }

    /// Sends `signal` (e.g. `libc::SIGSTOP`) to a worker process.
    pub fn signal_worker(&self, name: &str, signal: i32) {
        let (_, c) = self
            .workers
            .iter()
            .find(|(n, _)| n == name)
            .expect("worker exists");
        // SAFETY: signalling a child process of this test (not yet reaped: it is in `workers`).
        let r = unsafe { libc::kill(c.id() as i32, signal) };
        assert_eq!(r, 0, "signal {signal} to {name}");
    }

    /// The names of the joined decode workers with a sequence running (live stats).
    pub fn decoding(&self) -> Vec<String> {
        self.workers()
            .iter()
            .filter(|w| w["role"] == "decode" && w["stats"]["running"].as_u64() > Some(0))
            .map(|w| w["name"].as_str().unwrap_or_default().to_string())
            .collect()
    }

    /// Which ways the router's streams left their workers so far (for an assertion's message:
    /// a moved stream whose text differs says which path it took).
    pub fn paths(&self) -> String {
        let n = |name: &str| metric_sum(self.operator, name);
        format!(
            "paths so far: {} live moves ({} stayed), {} migrations, {} KV transfer failures",
            n("tandem_router_moves_total"),
            n("tandem_router_moves_stayed_total"),
            n("tandem_router_migrations_total"),
            n("tandem_kv_transfer_failures_total")
        )
    }

    /// The decode worker running the cluster's one stream, once it runs (within 10 s).
    pub fn serving(&self) -> String {
        let mut one = None;
        wait_until(
            "a decode worker runs the stream",
            Duration::from_secs(10),
            || {
                one = match self.decoding().as_slice() {
                    [w] => Some(w.clone()),
                    _ => None,
                };
                one.is_some()
            },
        );
        one.expect("found")
    }

    /// Opens a streamed chat completion of `message` to `model` with `params` (more JSON
    /// fields); asserts it is accepted.
    pub fn open_chat(
        &self,
        model: &str,
        message: &str,
        params: impl std::borrow::Borrow<Value>,
    ) -> Response {
        let mut body = serde_json::json!({"model": model, "stream": true,
                                          "messages": [{"role": "user", "content": message}]});
        let fields = params
            .borrow()
            .as_object()
            .expect("params are a JSON object");
        body.as_object_mut().unwrap().extend(fields.clone());
        let r = request(
            self.http,
            "POST",
            "/v1/chat/completions",
            "application/json",
            &body.to_string(),
        );
        let r = r.unwrap();
        assert_eq!(r.status, 200);
        r
    }

    /// Waits until exactly this many workers are joined.
    pub fn wait_for(&self, prefill: usize, decode: usize) {
        let what = format!("{prefill} + {decode} workers joined");
        wait_until(&what, Duration::from_secs(60), || {
            get(self.http, "/health").is_ok_and(|(_, body)| {
                let v: Value = serde_json::from_str(&body).unwrap_or_default();
                v["prefill_workers"] == prefill && v["decode_workers"] == decode
            })
        });
    }

    /// Live worker stats from `/debug/workers`.
    pub fn workers(&self) -> Vec<Value> {
        let (_, body) = get(self.operator, "/debug/workers").expect("debug endpoint");
        let v: Value = serde_json::from_str(&body).unwrap();
        v["workers"].as_array().cloned().unwrap_or_default()
    }

    /// Polls until the prefill workers report `n` KV transfers over `transport` in all (the
    /// router counts a transfer when the prefill call returns, which may be after the client's
    /// response is complete); panics after 10 s.
    pub fn wait_transfers(&self, transport: &str, n: u64) {
        let what = format!("{n} transfers over {transport}");
        wait_until(&what, Duration::from_secs(10), || {
            let count: u64 = self
                .workers()
                .iter()
                .filter(|w| w["role"] == "prefill")
                .map(|w| w["kv_transfers"][transport].as_u64().unwrap_or(0))
                .sum();
            count == n
        });
    }

    /// Polls until every worker reports all KV blocks free and nothing running; returns how
    /// long that took, or panics after `limit`.
    pub fn wait_all_free(&self, limit: Duration) -> Duration {
        wait_idle(limit, || self.workers())
    }
}

/// Whether every worker of `/debug/workers` is idle: every KV block free (or cached), nothing
/// running, waiting or pending, and its ownership ledger balanced.
pub fn all_idle(workers: &[Value]) -> bool {
    !workers.is_empty()
        && workers.iter().all(|w| {
            let s = &w["stats"];
            s["kv_blocks_free"] == s["kv_blocks_total"]
                && s["running"] == 0
                && s["waiting"] == 0
                && s["pending_transfers"] == 0
                && s["kv_blocks_reserved"] == 0
                && s["kv_blocks_in_flight"] == 0
                && s["kv_blocks_committed"] == 0
        })
}

/// Polls `workers` until [`all_idle`]; how long that took, or a panic after `limit`.
pub fn wait_idle(limit: Duration, workers: impl Fn() -> Vec<Value>) -> Duration {
    wait_until("every KV block free, nothing running", limit, || {
        all_idle(&workers())
    })
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for (_, c) in &mut self.workers {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = self.router.kill();
        let _ = self.router.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

pub(crate) fn unique() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    N.fetch_add(1, Ordering::SeqCst)
}

/// An HTTP response being read.
pub struct Response {
    /// Status code.
    pub status: u16,
    /// Header lines (`name: value`).
    pub headers: Vec<String>,
    reader: BufReader<reqwest::blocking::Response>,
}

impl Response {
    /// The rest of the body.
    pub fn body(mut self) -> String {
        let mut s = String::new();
        self.reader.read_to_string(&mut s).unwrap();
        s
    }

    /// The text of a chat stream's next `n` content chunks (fewer if it ends; `usize::MAX`:
    /// the rest of it).
    pub fn read_chunks(&mut self, n: usize) -> String {
        let mut text = String::new();
        for _ in 0..n {
            match self.next_event() {
                Some((name, data)) if data != "[DONE]" => {
                    assert_eq!(name, "message", "{data}");
                    let v: Value = serde_json::from_str(&data).unwrap();
                    text += v["choices"][0]["delta"]["content"].as_str().unwrap_or("");
                }
                _ => break,
            }
        }
        text
    }

    /// The next server-sent event's `(event name, data)`, or `None` at the end of the stream.
    pub fn next_event(&mut self) -> Option<(String, String)> {
        let (mut name, mut data) = (String::from("message"), None);
        loop {
            let mut line = String::new();
            if self.reader.read_line(&mut line).ok()? == 0 {
                return data.map(|d| (name, d));
            }
            let line = line.trim_end_matches(['\r', '\n']);
            if line.is_empty() {
                if let Some(d) = data {
                    return Some((name, d));
                }
                continue;
            }
            if let Some(v) = line.strip_prefix("event:") {
                name = v.trim().to_string();
            } else if let Some(v) = line.strip_prefix("data:") {
                data = Some(v.trim_start().to_string());
            }
        }
    }
}

/// The tests' HTTP client: one connection pool, generous deadlines (a stream may run long).
fn client() -> &'static reqwest::blocking::Client {
    static CLIENT: std::sync::OnceLock<reqwest::blocking::Client> = std::sync::OnceLock::new();
    CLIENT.get_or_init(|| {
        reqwest::blocking::Client::builder()
            .connect_timeout(Duration::from_secs(10))
            .timeout(Duration::from_secs(300))
            .build()
            .expect("an HTTP client")
    })
}

/// The model ids the router at `http` lists (`/v1/models`).
pub fn model_ids(http: SocketAddr) -> Vec<String> {
    let (_, text) = get(http, "/v1/models").unwrap();
    let v: Value = serde_json::from_str(&text).unwrap();
    v["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap().to_string())
        .collect()
}

/// Where a router listens, as it prints it.
#[derive(Debug, Clone, Copy)]
pub struct RouterAt {
    /// The API.
    pub http: SocketAddr,
    /// The control plane.
    pub control: SocketAddr,
    /// The operator endpoints.
    pub operator: SocketAddr,
}

/// The addresses in a router's line `tandem router: listening on http://H (control http://C,
/// operator http://O)`; `None` for any other line.
pub fn router_line(line: &str) -> Option<RouterAt> {
    let rest = line.strip_prefix("tandem router: listening on http://")?;
    let (h, rest) = rest.split_once(" (control http://")?;
    let (c, o) = rest.split_once(", operator http://")?;
    Some(RouterAt {
        http: h.parse().ok()?,
        control: c.parse().ok()?,
        operator: o.trim_end_matches(')').parse().ok()?,
    })
}

/// The value of the Prometheus series `series` (its name and labels as printed) at `at`'s
/// `/metrics` (a router's operator address, or a worker's metrics address), 0 when absent.
pub fn metric_at(at: SocketAddr, series: &str) -> f64 {
    let (_, text) = get(at, "/metrics").unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
        .unwrap_or(0.0)
}

/// The sum of metric `name`'s series at `at`, whatever their labels (0 when it has none).
pub fn metric_sum(at: SocketAddr, name: &str) -> f64 {
    let (_, text) = get(at, "/metrics").unwrap();
    text.lines()
        .filter_map(|l| {
            let rest = l.strip_prefix(name)?;
            let value = match rest.strip_prefix('{') {
                Some(labelled) => labelled.split_once("} ")?.1,
                None => rest.strip_prefix(' ')?,
            };
            value.trim().parse::<f64>().ok()
        })
        .sum()
}

/// Sends a request; returns once the status line and headers are read.
pub fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    content_type: &str,
    body: &str,
) -> std::io::Result<Response> {
    let method = reqwest::Method::from_bytes(method.as_bytes()).map_err(std::io::Error::other)?;
    let r = client()
        .request(method, format!("http://{addr}{path}"))
        .header("content-type", content_type)
        .body(body.to_string())
        .send()
        .map_err(std::io::Error::other)?;
    let headers = r
        .headers()
        .iter()
        .map(|(k, v)| format!("{k}: {}", v.to_str().unwrap_or_default()))
        .collect();
    Ok(Response {
        status: r.status().as_u16(),
        headers,
        reader: BufReader::new(r),
    })
}

/// POSTs JSON and returns the status and parsed body.
pub fn post_json(addr: SocketAddr, path: &str, body: &Value) -> (u16, Value) {
    let r = request(addr, "POST", path, "application/json", &body.to_string()).expect("request");
    let status = r.status;
    let text = r.body();
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

/// GETs a path; returns the status and the body.
pub fn get(addr: SocketAddr, path: &str) -> std::io::Result<(u16, String)> {
    let r = request(addr, "GET", path, "application/json", "")?;
    let status = r.status;
    Ok((status, r.body()))
}

/// `promtool check metrics` on a process's `/metrics` text: `Ok` or promtool's complaints.
pub fn promtool_check(text: &str) -> Result<(), String> {
    use std::io::Write;
    let mut p = std::process::Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .map_err(|e| {
            format!("promtool (Debian package `prometheus`, installed by .ci/run): {e}")
        })?;
    p.stdin.take().unwrap().write_all(text.as_bytes()).unwrap();
    let out = p.wait_with_output().unwrap();
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

/// Starts `exe up --config config` and reads what it prints until its ready lines end (the
/// line naming Ctrl-C); panics when it ends before.
pub fn tandem_up(exe: &Path, config: &Path) -> (std::process::Child, String) {
    let mut up = std::process::Command::new(exe)
        .args(["up", "--config"])
        .arg(config)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("tandem up starts");
    let mut out = std::io::BufReader::new(up.stdout.take().expect("piped"));
    let mut printed = String::new();
    while !printed.contains("Ctrl-C") {
        let mut line = String::new();
        let n = std::io::BufRead::read_line(&mut out, &mut line).expect("its output");
        assert!(n > 0, "tandem up ended early: {printed}");
        printed += &line;
    }
    (up, printed)
}
