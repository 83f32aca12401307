//! A whole cluster under `tandem up` (its supervisor included), for the tests that kill, freeze
//! and restart its processes: the router's address, what `tandem up` logs, and the pids and
//! router ids of its processes.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::cluster::get;

/// `tandem up` on a config of the test's, stopped with SIGINT (SIGKILL after 10 s) when dropped.
pub struct Up {
    child: Child,
    dir: PathBuf,
    /// The router's HTTP address.
    pub http: SocketAddr,
    /// The router's operator address (`/metrics`, `/status*`, `/debug/workers`).
    pub operator: SocketAddr,
    /// The config file's path (every process of the cluster has it on its command line).
    pub config: String,
    log: Arc<Mutex<String>>,
}

impl Up {
    /// Writes `toml` to a scratch directory and starts `tandem up` on it; returns once it
    /// printed the router's address (every worker has joined).
    pub fn start(exe: &Path, toml: &str) -> Up {
        Up::start_with_files(exe, toml, &[])
    }

    /// [`Up::start`], with more files beside cluster.toml (`(name, text)`: the cluster files
    /// its `[[models]]` name).
    pub fn start_with_files(exe: &Path, toml: &str, files: &[(&str, &str)]) -> Up {
        let n = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let dir = std::env::temp_dir().join(format!("tandem-up-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for (name, text) in files {
            std::fs::write(dir.join(name), text).unwrap();
        }
        let cfg = dir.join("cluster.toml");
        std::fs::write(&cfg, toml).unwrap();
        let config = cfg.to_string_lossy().to_string();
        let mut child = Command::new(exe)
            .args(["up", "--config", &config])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start tandem up");
        let (stdout, stderr) = (child.stdout.take().unwrap(), child.stderr.take().unwrap());
        let log = Arc::new(Mutex::new(String::new()));
        let sink = log.clone();
        std::thread::spawn(move || {
            for l in BufReader::new(stderr).lines().map_while(Result::ok) {
                sink.lock().unwrap().push_str(&(l + "\n"));
            }
        });
        let mut lines = BufReader::new(stdout).lines();
        let http = lines
            .by_ref()
            .map_while(Result::ok)
            .find_map(|l| l.split("behind http://").nth(1)?.trim().parse().ok());
        // The next line: "status page: http://OPERATOR/status (...)".
        let operator = lines.by_ref().map_while(Result::ok).find_map(|l| {
            let rest = l.strip_prefix("status page: http://")?;
            rest.split_once("/status")?.0.parse().ok()
        });
        // Keep reading what `tandem up` prints: a closed pipe would end it.
        std::thread::spawn(move || for _ in lines {});
        let mut up = Up {
            child,
            dir,
            http: "0.0.0.0:0".parse().unwrap(),
            operator: "0.0.0.0:0".parse().unwrap(),
            config,
            log,
        };
        up.http = http.unwrap_or_else(|| panic!("tandem up did not start:\n{}", up.log()));
        up.operator = operator.unwrap_or_else(|| panic!("no status page line:\n{}", up.log()));
        up
    }

    /// What `tandem up` and its processes wrote to stderr so far.
    pub fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    /// The pid of the cluster's process `who`: `router`, `store` (the embedded node), or a
    /// worker's name (`decode-0`).
    pub fn pid_of(&self, who: &str) -> Option<i32> {
        pid_of(&self.config, who)
    }

    /// Sends `signal` to the cluster's process `who`; its pid.
    pub fn signal(&self, who: &str, signal: i32) -> i32 {
        let pid = self
            .pid_of(who)
            .unwrap_or_else(|| panic!("{who} is not running"));
        // SAFETY: signalling a process of the cluster this test started.
        unsafe { libc::kill(pid, signal) };
        pid
    }

    /// The joined workers (`/debug/workers`, live stats included).
    pub fn workers(&self) -> Vec<Value> {
        let Ok((_, body)) = get(self.operator, "/debug/workers") else {
            return Vec::new();
        };
        let v: Value = serde_json::from_str(&body).unwrap_or_default();
        v["workers"].as_array().cloned().unwrap_or_default()
    }

    /// The router's ids of the joined workers named `name`.
    pub fn ids_of(&self, name: &str) -> Vec<u64> {
        self.workers()
            .iter()
            .filter(|w| w["name"] == name)
            .filter_map(|w| w["id"].as_u64())
            .collect()
    }

    /// Waits (up to `limit`) until the router has exactly `prefill` + `decode` workers, none
    /// stalled; how long it took.
    pub fn wait_joined(&self, prefill: usize, decode: usize, limit: Duration) -> Duration {
        let what = format!("{prefill} + {decode} workers joined, none stalled");
        crate::wait_until(&what, limit, || {
            let ws = self.workers();
            let count = |role: &str| {
                ws.iter()
                    .filter(|w| w["role"] == role && w["stalled"] == false)
                    .count()
            };
            count("prefill") == prefill && count("decode") == decode
        })
    }

    /// The scratch directory its cluster.toml is in.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

/// The pid of process `who` (`router`, or a worker's name) of the cluster `tandem up` runs from
/// config file `config`.
pub fn pid_of(config: &str, who: &str) -> Option<i32> {
    let wanted: Vec<&str> = match who {
        "router" => vec!["router"],
        "store" => vec!["store", "--config"],
        name => vec!["--name", name],
    };
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let pid: i32 = e.file_name().to_str()?.parse().ok()?;
        let cmd = std::fs::read(e.path().join("cmdline")).ok()?;
        let args: Vec<String> = cmd
            .split(|&b| b == 0)
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        let has = |w: &[&str]| {
            args.windows(w.len())
                .any(|x| x.iter().zip(w).all(|(a, b)| a == b))
        };
        let ours = args.iter().any(|a| a == config);
        let up = args.get(1).map(String::as_str) == Some("up");
        (ours && !up && has(&wanted)).then_some(pid)
    })
}

impl Drop for Up {
    fn drop(&mut self) {
        // SAFETY: signalling our own child; `tandem up` stops everything it started.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGINT) };
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_secs(10) {
            if let Ok(Some(_)) = self.child.try_wait() {
                let _ = std::fs::remove_dir_all(&self.dir);
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
