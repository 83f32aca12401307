//! Headless Chromium (Debian's `chromium`) driven over the DevTools protocol: one page, JS
//! evaluated in it (promises awaited, with their own deadlines), screenshots. The browser is
//! killed when the [`Browser`] drops.

use std::io::{BufRead, BufReader};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use base64::Engine as _;
use serde_json::{json, Value};
use tungstenite::{Message, WebSocket};

/// The browser binary: `$CHROMIUM`, else `chromium` on the PATH.
pub fn binary() -> PathBuf {
    std::env::var_os("CHROMIUM")
        .map(PathBuf::from)
        .unwrap_or_else(|| "chromium".into())
}

/// A headless browser with one page open.
pub struct Browser {
    child: Child,
    profile: PathBuf,
    page: WebSocket<TcpStream>,
    next_id: u64,
    /// Events read while waiting for a command's answer.
    events: Vec<Value>,
}

impl Browser {
    /// Starts Chromium in a `width` × `height` window and loads `url`.
    pub fn open(url: &str, width: u32, height: u32) -> Browser {
        let profile = std::env::temp_dir().join(format!(
            "tandem-chromium-{}-{}",
            std::process::id(),
            crate::cluster::unique()
        ));
        let mut child = Command::new(binary())
            .args([
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--no-first-run",
                "--hide-scrollbars",
                "--remote-debugging-address=127.0.0.1",
                "--remote-debugging-port=0",
            ])
            .arg(format!("--user-data-dir={}", profile.display()))
            .arg(format!("--window-size={width},{height}"))
            .arg("about:blank")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "cannot start {} ({e}): install Debian's chromium (scripts/test.sh does) or set CHROMIUM",
                    binary().display()
                )
            });
        // It says where its DevTools endpoint listens, then keeps logging: drain it after.
        let mut lines = BufReader::new(child.stderr.take().expect("piped")).lines();
        let port = loop {
            let line = lines
                .next()
                .expect("chromium printed its DevTools address")
                .expect("chromium's output");
            if let Some(rest) = line.strip_prefix("DevTools listening on ws://127.0.0.1:") {
                break rest.split('/').next().unwrap().parse::<u16>().unwrap();
            }
        };
        std::thread::spawn(move || for _ in lines {});
        let list: Value = reqwest::blocking::get(format!("http://127.0.0.1:{port}/json/list"))
            .and_then(|r| r.json())
            .expect("DevTools target list");
        let ws_url = list
            .as_array()
            .and_then(|ts| ts.iter().find(|t| t["type"] == "page"))
            .and_then(|t| t["webSocketDebuggerUrl"].as_str())
            .expect("a page target")
            .to_string();
        let stream = TcpStream::connect(("127.0.0.1", port)).expect("DevTools socket");
        // Every read has a deadline: a browser that stops answering fails the test.
        stream
            .set_read_timeout(Some(Duration::from_secs(60)))
            .unwrap();
        let (page, _) = tungstenite::client(ws_url.as_str(), stream).expect("DevTools handshake");
        let mut b = Browser {
            child,
            profile,
            page,
            next_id: 0,
            events: Vec::new(),
        };
        // Navigate from the blank page and wait for the load, so that nothing evaluated later
        // runs in a page about to go away.
        b.call("Page.enable", json!({}));
        let viewport =
            json!({"width": width, "height": height, "deviceScaleFactor": 1, "mobile": false});
        b.call("Emulation.setDeviceMetricsOverride", viewport);
        b.call("Page.navigate", json!({"url": url}));
        b.wait_event("Page.loadEventFired");
        b
    }

    fn read(&mut self) -> Value {
        let m = self.page.read().expect("DevTools message within 60 s");
        match m {
            Message::Text(t) => serde_json::from_str(t.as_str()).expect("DevTools JSON"),
            _ => Value::Null,
        }
    }

    /// Waits for the next event `method` (or takes one already read).
    pub fn wait_event(&mut self, method: &str) -> Value {
        if let Some(i) = self.events.iter().position(|e| e["method"] == method) {
            return self.events.remove(i);
        }
        loop {
            let v = self.read();
            if v["method"] == method {
                return v;
            }
        }
    }

    /// Sends a DevTools command and returns its result (events in between are skipped).
    pub fn call(&mut self, method: &str, params: Value) -> Value {
        self.next_id += 1;
        let id = self.next_id;
        let msg = json!({"id": id, "method": method, "params": params}).to_string();
        self.page.send(Message::text(msg)).expect("DevTools send");
        loop {
            let v = self.read();
            if v["id"] == id {
                assert!(v["error"].is_null(), "{method}: {}", v["error"]);
                return v["result"].clone();
            }
            if v["method"].is_string() {
                self.events.push(v);
            }
        }
    }

    /// Evaluates `js` in the page (awaiting it if it is a promise) and returns its value, or
    /// the exception it threw.
    pub fn eval(&mut self, js: &str) -> Result<Value, String> {
        let r = self.call(
            "Runtime.evaluate",
            json!({"expression": js, "awaitPromise": true, "returnByValue": true}),
        );
        match r.get("exceptionDetails") {
            Some(e) => Err(e["exception"]["description"]
                .as_str()
                .map_or_else(|| e.to_string(), str::to_string)),
            None => Ok(r["result"]["value"].clone()),
        }
    }

    /// A PNG of what the page shows.
    pub fn screenshot(&mut self) -> Vec<u8> {
        let r = self.call("Page.captureScreenshot", json!({"format": "png"}));
        let data = r["data"].as_str().expect("screenshot data");
        base64::engine::general_purpose::STANDARD
            .decode(data)
            .expect("base64 PNG")
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.profile);
    }
}

/// What a PNG shows, in numbers: its size, how many distinct colours, and the share of pixels
/// that are not its most common colour (the background).
pub fn png_summary(bytes: &[u8]) -> (u32, u32, usize, f64) {
    let decoder = png::Decoder::new(std::io::Cursor::new(bytes));
    let mut reader = decoder.read_info().expect("a PNG");
    let mut buf = vec![0; reader.output_buffer_size()];
    let info = reader.next_frame(&mut buf).expect("a PNG frame");
    let px = info.color_type.samples();
    let mut counts = std::collections::HashMap::<&[u8], usize>::new();
    for p in buf[..info.buffer_size()].chunks(px) {
        *counts.entry(p).or_default() += 1;
    }
    let total = (info.width * info.height) as f64;
    let background = counts.values().max().copied().unwrap_or(0) as f64;
    (
        info.width,
        info.height,
        counts.len(),
        1.0 - background / total,
    )
}
