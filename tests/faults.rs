//! Faults on the KV path: a proxy between the prefill and the decode worker corrupts a byte,
//! cuts the connection, or stalls it. Each broken transfer must end (checksum, reset, deadline),
//! the decode worker must free the reserved blocks, and the client must still get the right
//! answer (the router recomputes the prompt on the decode worker) — never a success with a
//! broken answer, never a hang.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use engine::{ChatMessage, Engine, EngineConfig, SamplingParams};
use serde_json::json;
use tandem_tests::cluster::{post_json, Cluster};
use tandem_tests::load_model;

const EXE: &str = env!("CARGO_BIN_EXE_tandem");

#[derive(Debug, Clone, Copy)]
enum Fault {
    /// Flip one bit of the KV payload.
    Corrupt,
    /// Close both directions mid-transfer.
    Cut,
    /// Stop forwarding mid-transfer, keeping the connection open.
    Stall,
    /// Forward faithfully.
    Pass,
}

/// Bytes forwarded untouched first: the handshake and the start of the first transfer.
const CLEAN_PREFIX: usize = 4096;

/// Accepts connections and forwards them to `target` (set once known), applying `faults[i]`
/// to the i-th connection's client-to-server direction (the last fault repeats).
fn proxy(faults: Vec<Fault>) -> (SocketAddr, Arc<Mutex<Option<SocketAddr>>>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let target = Arc::new(Mutex::new(None::<SocketAddr>));
    let t = target.clone();
    std::thread::spawn(move || {
        for (i, c) in l.incoming().enumerate() {
            let Ok(client) = c else { return };
            let fault = faults[i.min(faults.len() - 1)];
            let to = t
                .lock()
                .unwrap()
                .expect("target known before the first transfer");
            let server = TcpStream::connect(to).unwrap();
            let (mut c2, mut s2) = (client.try_clone().unwrap(), server.try_clone().unwrap());
            std::thread::spawn(move || {
                let _ = std::io::copy(&mut s2, &mut c2);
                let _ = c2.shutdown(Shutdown::Both);
            });
            std::thread::spawn(move || pump(client, server, fault));
        }
    });
    (addr, target)
}

fn pump(mut from: TcpStream, mut to: TcpStream, fault: Fault) {
    let mut buf = vec![0u8; 16 << 10];
    let mut seen = 0usize;
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        let chunk = &mut buf[..n];
        if seen + n > CLEAN_PREFIX {
            let at = CLEAN_PREFIX.saturating_sub(seen);
            match fault {
                Fault::Corrupt => chunk[at] ^= 0x10,
                Fault::Cut => {
                    let _ = to.write_all(&chunk[..at]);
                    let _ = to.shutdown(Shutdown::Both);
                    let _ = from.shutdown(Shutdown::Both);
                    return;
                }
                Fault::Stall => {
                    let _ = to.write_all(&chunk[..at]);
                    std::thread::sleep(Duration::from_secs(20));
                    return;
                }
                Fault::Pass => {}
            }
        }
        if to.write_all(chunk).is_err() {
            break;
        }
        seen += n;
        if matches!(fault, Fault::Corrupt) && seen > CLEAN_PREFIX {
            // One flipped bit is enough; forward the rest faithfully.
            let _ = std::io::copy(&mut from, &mut to);
            break;
        }
    }
    let _ = to.shutdown(Shutdown::Write);
}

#[test]
fn corrupted_cut_and_stalled_transfers_end_cleanly_and_free_their_blocks() {
    let kv = "prefer = [\"tcp\"]\ntransfer_timeout_ms = 1500\nconnect_timeout_ms = 1000";
    let mut c = Cluster::of(1, 0).kv(kv).start(EXE.as_ref());
    let (proxy_addr, target) = proxy(vec![Fault::Corrupt, Fault::Cut, Fault::Stall, Fault::Pass]);
    let cfg = c.config(&Cluster::of(1, 1).kv(kv));
    let advertise = proxy_addr.to_string();
    let mut decode =
        c.spawn_worker_with("decode", "decode-0", &cfg, &["--kv-advertise", &advertise]);
    let mut lines = BufReader::new(decode.stderr.take().unwrap()).lines();
    let kv_addr: SocketAddr = loop {
        let line = lines.next().expect("decode output").unwrap();
        if let Some(rest) = line.split(", KV on tcp ").nth(1) {
            break rest.split_whitespace().next().unwrap().parse().unwrap();
        }
    };
    std::thread::spawn(move || for _ in lines {});
    *target.lock().unwrap() = Some(kv_addr);
    c.adopt("decode-0", decode);
    c.wait_for(1, 1);

    let (model, tok) = load_model();
    let n = 6;
    for i in 0..n {
        let q = format!("Name {} colours of the rainbow.", 2 + i);
        let (status, v) = post_json(
            c.http,
            "/v1/chat/completions",
            &json!({"temperature": 0, "max_tokens": 12, "messages": [{"role": "user", "content": q}]}),
        );
        assert_eq!(status, 200, "request {i}: {v}");
        let text = tok
            .apply_chat_template(&[ChatMessage::user(&q)], true)
            .unwrap();
        let mut e = Engine::new(
            model.clone(),
            EngineConfig::default(),
            tok.stop_ids().to_vec(),
        )
        .unwrap();
        e.add(
            engine::RequestId(0),
            tok.encode(&text).unwrap(),
            SamplingParams::greedy(12),
        )
        .unwrap();
        let mut want = e
            .run_to_completion()
            .unwrap()
            .remove(&engine::RequestId(0))
            .unwrap();
        if want.last().is_some_and(|t| tok.stop_ids().contains(t)) {
            want.pop();
        }
        assert_eq!(
            v["choices"][0]["message"]["content"],
            tok.decode(&want, true).unwrap(),
            "request {i}"
        );
    }
    // Three transfers broke (and were recomputed on the decode worker); the rest went through.
    c.wait_transfers("tcp", n as u64 - 3);
    c.wait_all_free(Duration::from_secs(5));
}
