//! The disaggregated cluster end to end: router, prefill and decode workers as real processes
//! on loopback, driven over HTTP. Each test starts its own cluster and kills it when done.

use std::time::{Duration, Instant};

use engine::{Engine, EngineConfig, SamplingParams};
use serde_json::{json, Value};
use tandem_tests::cluster::{metric_at, post_json, request, Cluster};
use tandem_tests::engine_chat as engine_text;

const EXE: &str = env!("CARGO_BIN_EXE_tandem");
const MODEL: &str = "SmolLM2-135M-Instruct.Q4_1";

/// Streams a chat completion; returns the concatenated text, the finish reason and the usage.
fn stream_chat(c: &Cluster, body: Value) -> (String, String, Value) {
    let mut r = request(
        c.http,
        "POST",
        "/v1/chat/completions",
        "application/json",
        &body.to_string(),
    )
    .unwrap();
    assert_eq!(r.status, 200);
    let (mut text, mut finish, mut usage) = (String::new(), String::new(), Value::Null);
    while let Some((name, data)) = r.next_event() {
        assert_eq!(name, "message", "unexpected event {name}: {data}");
        if data == "[DONE]" {
            return (text, finish, usage);
        }
        let v: Value = serde_json::from_str(&data).unwrap();
        if let Some(u) = v.get("usage") {
            usage = u.clone();
        }
        if let Some(ch) = v["choices"].get(0) {
            text += ch["delta"]["content"].as_str().unwrap_or("");
            if let Some(f) = ch["finish_reason"].as_str() {
                finish = f.to_string();
            }
        }
    }
    panic!("stream ended without [DONE]");
}

#[test]
fn disaggregated_stream_equals_engine_greedy_and_seeded() {
    let c = Cluster::start(EXE.as_ref(), 1, 1);
    let q = "What is the capital city of Germany?";
    let (text, finish, usage) = stream_chat(
        &c,
        json!({"model": MODEL, "messages": [{"role": "user", "content": q}], "stream": true, "temperature": 0,
               "max_tokens": 40, "stream_options": {"include_usage": true}}),
    );
    let (want, n) = engine_text(q, SamplingParams::greedy(40));
    assert_eq!(text, want);
    assert!(text.contains("Berlin"), "{text}");
    assert_eq!(finish, "stop");
    assert_eq!(usage["completion_tokens"], n);
    let params = SamplingParams {
        max_tokens: Some(48),
        temperature: 0.8,
        top_p: 0.95,
        seed: 42,
        ..Default::default()
    };
    let (text, _, _) = stream_chat(
        &c,
        json!({"model": MODEL, "messages": [{"role": "user", "content": "Write a haiku about the sea."}], "stream": true,
               "temperature": 0.8, "top_p": 0.95, "seed": 42, "max_tokens": 48}),
    );
    assert_eq!(text, engine_text("Write a haiku about the sea.", params).0);
    c.wait_all_free(Duration::from_secs(5));
    c.wait_transfers("tcp", 2);
}

#[test]
fn colocated_cluster_answers_berlin() {
    let c = Cluster::start(EXE.as_ref(), 0, 1);
    let (status, v) = post_json(
        c.http,
        "/v1/chat/completions",
        &json!({"model": MODEL, "temperature": 0, "messages": [{"role": "user", "content": "What is the capital city of Germany?"}]}),
    );
    assert_eq!(status, 200, "{v}");
    assert!(
        v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .contains("Berlin"),
        "{v}"
    );
}

#[test]
fn sixteen_concurrent_requests_match_single_process_and_free_their_blocks() {
    let c = Cluster::start(EXE.as_ref(), 1, 1);
    let questions: Vec<String> = (0..16)
        .map(|i| {
            format!(
                "{} Question {i}: what is {} plus {}?",
                "Please answer briefly. ".repeat(i % 5),
                i * 7,
                i + 3
            )
        })
        .collect();
    let answers: Vec<(u16, Value)> = std::thread::scope(|s| {
        let hs: Vec<_> = questions
            .iter()
            .enumerate()
            .map(|(i, q)| {
                let body = json!({"model": MODEL, "temperature": 0, "max_tokens": 8 + i % 9, "messages": [{"role": "user", "content": q}]});
                let http = c.http;
                s.spawn(move || post_json(http, "/v1/chat/completions", &body))
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (i, (q, (status, v))) in questions.iter().zip(answers).enumerate() {
        assert_eq!(status, 200, "{v}");
        let (want, _) = engine_text(q, SamplingParams::greedy(8 + i % 9));
        assert_eq!(v["choices"][0]["message"]["content"], want, "request {i}");
    }
    c.wait_all_free(Duration::from_secs(5));
    // Each request went through the decode worker's ledger: reserved, in flight, committed, freed.
    let freed: u64 = c
        .workers()
        .iter()
        .filter(|w| w["role"] == "decode")
        .map(|w| w["stats"]["kv_requests_freed"].as_u64().unwrap())
        .sum();
    assert_eq!(freed, 16, "{:?}", c.workers());
    c.wait_transfers("tcp", 16);
}

#[test]
fn client_disconnect_frees_kv_on_both_workers_within_a_second() {
    let c = Cluster::start(EXE.as_ref(), 1, 1);
    let body = json!({"model": MODEL, "stream": true, "max_tokens": 4000, "ignore_eos": true,
                      "messages": [{"role": "user", "content": "Tell me a very long story."}]});
    let mut r = request(
        c.http,
        "POST",
        "/v1/chat/completions",
        "application/json",
        &body.to_string(),
    )
    .unwrap();
    for _ in 0..5 {
        r.next_event().expect("tokens stream");
    }
    let busy = c.workers();
    let decode = busy.iter().find(|w| w["role"] == "decode").unwrap();
    assert!(
        decode["stats"]["kv_blocks_free"].as_u64() < decode["stats"]["kv_blocks_total"].as_u64(),
        "{busy:?}"
    );
    drop(r);
    let took = c.wait_all_free(Duration::from_secs(1));
    println!("blocks freed on both workers {took:?} after the disconnect");
    c.wait_transfers("tcp", 1);
}

/// A client that goes away while the prefill worker computes its prompt: both workers' blocks
/// are freed. The router answers a stream's headers only with its first token, so the request
/// is written on a raw socket, which is closed as soon as the prefill worker reports the
/// prompt's blocks held (a 3,000-token prompt takes seconds here, many heartbeats of 250 ms).
#[test]
fn a_client_gone_during_the_prefill_frees_the_prefill_workers_blocks_too() {
    use std::io::Write;
    let c = Cluster::start(EXE.as_ref(), 1, 1);
    let prompt: Vec<u32> = (0..3000).map(|i| 300 + (i * 7919) % 40_000).collect();
    let body =
        json!({"model": MODEL, "prompt": prompt, "max_tokens": 8, "stream": true}).to_string();
    let mut conn = std::net::TcpStream::connect(c.http).unwrap();
    write!(
        conn,
        "POST /v1/completions HTTP/1.1\r\nhost: tandem\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let computing = |c: &Cluster| {
        c.workers().iter().any(|w| {
            let s = &w["stats"];
            w["role"] == "prefill" && s["kv_blocks_free"].as_u64() < s["kv_blocks_total"].as_u64()
        })
    };
    let t0 = Instant::now();
    while !computing(&c) {
        assert!(t0.elapsed() < Duration::from_secs(10), "the prefill starts");
        std::thread::sleep(Duration::from_millis(10));
    }
    drop(conn);
    let took = c.wait_all_free(Duration::from_secs(2));
    println!("blocks freed on both workers {took:?} after the client left mid-prefill");
    let w = c.workers();
    let prefill = w.iter().find(|w| w["role"] == "prefill").unwrap();
    assert_eq!(
        prefill["kv_transfers"]["tcp"].as_u64().unwrap_or(0),
        0,
        "the prefill was cut short, nothing sent: {prefill}"
    );
}

/// A second architecture end to end: Gemma 3 270M (SentencePiece, sliding windows, K-quants)
/// on a disaggregated CPU cluster answers a 655-token raw prompt (past the 512-token window)
/// through `/v1/completions` with the tokens the engine alone produces, its KV moved over TCP
/// with the windowed layers' window only (the bytes counted by the prefill worker); a chat
/// request is a clear 400 (a base model has no chat template).
#[test]
fn a_cluster_serves_gemma3_through_completions() {
    let g = tandem_tests::gemma3_golden();
    let case = g
        .cases
        .iter()
        .find(|c| c.prompt_ids.len() > 600 && c.prompt_ids.len() < 1000)
        .unwrap();
    let (model, tok) = tandem_tests::load_gemma3();
    let mut e = Engine::new(model, EngineConfig::default(), tok.stop_ids().to_vec()).unwrap();
    e.add(
        engine::RequestId(0),
        case.prompt_ids.clone(),
        SamplingParams::greedy(12),
    )
    .unwrap();
    let want = tok
        .decode(
            &e.run_to_completion()
                .unwrap()
                .remove(&engine::RequestId(0))
                .unwrap(),
            true,
        )
        .unwrap();
    drop(e);
    let toml = "[router]\nlisten = \"127.0.0.1:0\"\ncontrol = \"127.0.0.1:0\"\noperator = \"127.0.0.1:0\"\nlocal_prefill_max_tokens = 0\n\n[prefill]\nthreads = 1\nkv_blocks = 128\n\n[decode]\nthreads = 1\nkv_blocks = 128\n\n[kv_transfer]\nprefer = [\"tcp\"]\n";
    let c = Cluster::of(1, 1)
        .model(&tandem_tests::gemma3_path())
        .toml(toml)
        .start(EXE.as_ref());
    let body = json!({"model": "gemma-3-270m-q4_k_m", "prompt": case.text, "max_tokens": 12, "temperature": 0});
    let (status, v) = post_json(c.http, "/v1/completions", &body);
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"][0]["text"], want.as_str(), "{v}");
    assert_eq!(
        v["usage"]["prompt_tokens"],
        case.prompt_ids.len(),
        "the router's tokenisation"
    );
    c.wait_transfers("tcp", 1);
    // All but the last prompt token: 3 global layers whole, 15 windowed ones their 511 tokens
    // (width 256, f16 keys and values).
    let n = case.prompt_ids.len() - 1;
    let window_only = 4 * 256 * (3 * n + 15 * 511);
    let ws = c.workers();
    let prefill = ws.iter().find(|w| w["role"] == "prefill").unwrap();
    let at = prefill["metrics_endpoint"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    let sent =
        tandem_tests::cluster::metric_at(at, "tandem_kv_sent_bytes_total{transport=\"tcp\"}");
    assert_eq!(
        sent as usize,
        window_only,
        "every layer whole would be {}",
        4 * 256 * 18 * n
    );
    let chat =
        json!({"model": "gemma-3-270m-q4_k_m", "messages": [{"role": "user", "content": "hi"}]});
    let (status, v) = post_json(c.http, "/v1/chat/completions", &chat);
    assert_eq!(status, 400, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("no chat template"),
        "{v}"
    );
    println!("Gemma 3 through the cluster: {want:?}");
}

#[test]
fn bad_requests_get_openai_errors() {
    let c = Cluster::start(EXE.as_ref(), 1, 1);
    let check = |path: &str, ct: &str, body: &str, status: u16, needle: &str| {
        let r = request(c.http, "POST", path, ct, body).unwrap();
        assert_eq!(r.status, status, "{body}");
        let v: Value = serde_json::from_str(&r.body()).unwrap();
        let msg = v["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        assert!(
            v["error"]["type"].is_string() && msg.contains(needle),
            "{body} -> {v}"
        );
    };
    let chat = "/v1/chat/completions";
    let msgs = r#""messages": [{"role": "user", "content": "hi"}]"#;
    check(
        chat,
        "application/json",
        "{not json",
        400,
        "invalid request body",
    );
    check(
        chat,
        "text/plain",
        &format!("{{{msgs}}}"),
        415,
        "application/json",
    );
    check(
        chat,
        "application/json",
        &format!(r#"{{"model": "gpt-9", {msgs}}}"#),
        404,
        "does not exist",
    );
    check(
        chat,
        "application/json",
        &format!(r#"{{"max_tokens": -1, {msgs}}}"#),
        400,
        "at least 1",
    );
    check(
        chat,
        "application/json",
        &format!(r#"{{"max_tokens": 99999999, {msgs}}}"#),
        400,
        "at most",
    );
    check(
        chat,
        "application/json",
        r#"{"messages": []}"#,
        400,
        "must not be empty",
    );
    check(
        chat,
        "application/json",
        r#"{"messages": "hi"}"#,
        400,
        "invalid request body",
    );
    check(
        chat,
        "application/json",
        &format!(r#"{{"n": 30, {msgs}}}"#),
        400,
        "n must be between 1 and 16",
    );
    check(
        chat,
        "application/json",
        &format!(r#"{{"temperature": 7, {msgs}}}"#),
        400,
        "temperature",
    );
    let long = "hello ".repeat(9000);
    check(
        "/v1/completions",
        "application/json",
        &json!({"prompt": long}).to_string(),
        400,
        "context",
    );
    check(
        "/v1/completions",
        "application/json",
        r#"{"prompt": [1, 2, 99999999]}"#,
        400,
        "vocabulary",
    );
    check("/v1/nothing", "application/json", "{}", 404, "no endpoint");
    // The cluster still serves.
    let (status, _) = post_json(
        c.http,
        chat,
        &json!({"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}),
    );
    assert_eq!(status, 200);
}

#[test]
fn worker_with_mismatched_kv_layout_is_refused_at_join() {
    let c = Cluster::start(EXE.as_ref(), 0, 1);
    // Beside the cluster's own file: it holds the cluster's certificates, so the router hears
    // it out and refuses it for its layout.
    let cfg = c.config(&Cluster::of(0, 1).block_size(32));
    let out = c
        .spawn_worker("decode", "odd-one", &cfg)
        .wait_with_output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("refused") && err.contains("block_size: 16 vs 32"),
        "{err}"
    );
    c.wait_for(0, 1);
}

#[test]
fn official_openai_python_client_streams_a_chat_completion() {
    let c = Cluster::start(EXE.as_ref(), 1, 1);
    let script = format!(
        r#"
import openai
client = openai.OpenAI(base_url="http://{}/v1", api_key="unused")
stream = client.chat.completions.create(model="{MODEL}", messages=[{{"role": "user", "content": "What is the capital city of Germany?"}}], temperature=0, max_tokens=30, stream=True)
print("".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices))
"#,
        c.http
    );
    let out = std::process::Command::new("python3")
        .arg("-c")
        .arg(script)
        .output()
        .expect("python3 runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "the openai client failed (pip install openai): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("Berlin"), "{stdout}");
    c.wait_transfers("tcp", 1);
}

#[test]
fn a_full_decode_worker_makes_requests_wait_not_fail() {
    // 10 blocks of 16 tokens: one request (about 40 prompt + 64 new tokens = 7 blocks) at a time.
    let c = Cluster::of(1, 1).decode_blocks(10).start(EXE.as_ref());
    let answers: Vec<(u16, Value)> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..4)
            .map(|i| {
                let body = json!({"model": MODEL, "temperature": 0, "max_tokens": 64, "ignore_eos": true,
                                  "messages": [{"role": "user", "content": format!("Count to {}.", 10 + i)}]});
                let http = c.http;
                s.spawn(move || post_json(http, "/v1/chat/completions", &body))
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (i, (status, v)) in answers.iter().enumerate() {
        assert_eq!(*status, 200, "{v}");
        let want = engine_text(
            &format!("Count to {}.", 10 + i),
            SamplingParams {
                ignore_eos: true,
                ..SamplingParams::greedy(64)
            },
        )
        .0;
        assert_eq!(v["choices"][0]["message"]["content"], want, "request {i}");
        assert_eq!(v["usage"]["completion_tokens"], 64);
    }
    c.wait_all_free(Duration::from_secs(5));
    c.wait_transfers("tcp", 4);
}

#[test]
fn tandem_up_brings_the_cluster_up_its_printed_request_works_and_ctrl_c_stops_everything() {
    let dir = std::env::temp_dir().join(format!("tandem-up-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = Cluster::of(1, 1).write(&dir);
    let (mut up, printed) = tandem_tests::cluster::tandem_up(EXE.as_ref(), &cfg);
    // The printed curl: its URL and its JSON body, sent as printed.
    let url = printed
        .split("curl http://")
        .nth(1)
        .unwrap()
        .split_whitespace()
        .next()
        .unwrap();
    let (addr, path) = url.split_once('/').unwrap();
    let body = printed
        .split("-d '")
        .nth(1)
        .unwrap()
        .split('\'')
        .next()
        .unwrap();
    let (status, v) = post_json(
        addr.parse().unwrap(),
        &format!("/{path}"),
        &serde_json::from_str(body).unwrap(),
    );
    assert_eq!(status, 200, "{v}");
    assert!(
        v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .contains("Berlin"),
        "{v}"
    );
    // Through the prefill pool: the router counted the KV it moved (the counter comes when the
    // prefill call returns, possibly just after the answer).
    // ... on the operator's address, which `tandem up` printed too (the API's port has none).
    let at: std::net::SocketAddr = printed
        .split("status page: http://")
        .nth(1)
        .and_then(|r| r.split_once("/status"))
        .map(|(a, _)| a.parse().unwrap())
        .unwrap_or_else(|| panic!("no status page line: {printed}"));
    let t0 = Instant::now();
    loop {
        let (_, m) = tandem_tests::cluster::get(at, "/metrics").unwrap();
        let bytes = m
            .lines()
            .find_map(|l| l.strip_prefix("tandem_kv_transfer_bytes_total{transport=\"tcp\"} "))
            .and_then(|v| v.trim().parse::<f64>().ok());
        if bytes.is_some_and(|b| b > 0.0) {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "no KV moved: {m}");
        std::thread::sleep(Duration::from_millis(20));
    }
    // Ctrl-C: tandem up stops every child and exits.
    // SAFETY: signalling our own child process.
    unsafe { libc::kill(up.id() as i32, libc::SIGINT) };
    let t0 = Instant::now();
    while up.try_wait().unwrap().is_none() {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "tandem up did not stop"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(
        tandem_tests::cluster::get(addr.parse().unwrap(), "/health").is_err(),
        "the router still answers"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Pools on `device = "cuda:0"`, on the CPU CUDA emulator (`kernels/emu`, a test double, not a
/// GPU): both on the GPU, and each mixed with a CPU pool (a CPU worker's KV and a GPU worker's
/// are the same on the wire). A GPU prefill's KV leaves its device layer by layer through pinned
/// staging and crosses TCP; a GPU decode worker uploads it into its device pool. The answer is
/// Berlin each time, the ledger balances, and the emulator's launch log shows which workers ran
/// attention on the GPU.
#[cfg(feature = "cuda")]
#[test]
fn clusters_with_cuda_pools_answer_berlin_on_the_cuda_emulator() {
    let lib = kernels::cuda::emu::build(env!("CARGO_TARGET_TMPDIR").as_ref()).unwrap();
    let gpu = "device = \"cuda:0\"";
    for (pools, on_gpu) in [([gpu, gpu], 2), (["", gpu], 1), ([gpu, ""], 1)] {
        let log = std::env::temp_dir().join(format!("tandem-emu-{}.log", std::process::id()));
        let _ = std::fs::remove_file(&log);
        let mut env = kernels::cuda::emu::environment(&lib);
        env.push(("TANDEM_CUDA_EMU_LOG".into(), log.display().to_string()));
        let c = Cluster::of(1, 1)
            .decode_blocks(64)
            .kv("prefer = [\"tcp\"]")
            .pools(pools)
            .env(&env)
            .start(EXE.as_ref());
        let (text, _, _) = stream_chat(
            &c,
            json!({"model": MODEL, "messages": [{"role": "user", "content": "What is the capital city of Germany?"}],
                   "stream": true, "temperature": 0, "max_tokens": 12}),
        );
        assert!(text.contains("Berlin"), "{pools:?}: {text}");
        c.wait_transfers("tcp", 1);
        c.wait_all_free(Duration::from_secs(5));
        let launches = std::fs::read_to_string(&log).unwrap_or_default();
        let pids: std::collections::BTreeSet<&str> = launches
            .lines()
            .filter(|l| l.ends_with(" paged_attention"))
            .filter_map(|l| l.split(' ').next())
            .collect();
        assert_eq!(
            pids.len(),
            on_gpu,
            "{pools:?}: workers that ran attention on cuda:0:\n{launches}"
        );
        let _ = std::fs::remove_file(&log);
    }
}

/// Two models behind one address: a SmolLM2 cluster whose router answers for a Gemma 3
/// cluster's (`[router] models`) serves each by name — Gemma's answer is the Gemma engine's own,
/// whole and streamed, and was served by the Gemma router (its request count, the front's
/// forward count); `/v1/models` lists both; an unknown name is a 404 listing them.
#[test]
fn one_router_answers_for_two_models_by_name() {
    let gemma_toml = "[router]\nlisten = \"127.0.0.1:0\"\ncontrol = \"127.0.0.1:0\"\noperator = \"127.0.0.1:0\"\n\n[decode]\nthreads = 1\nkv_blocks = 64\n";
    let g = Cluster::of(0, 1)
        .model(&tandem_tests::gemma3_path())
        .toml(gemma_toml)
        .start(EXE.as_ref());
    let gemma = "gemma-3-270m-q4_k_m";
    let front = Cluster::of(0, 1)
        .router(&format!("models = {{ \"{gemma}\" = \"{}\" }}", g.http))
        .start(EXE.as_ref());
    let prompt = "The capital of France is";
    let (model, tok) = tandem_tests::load_gemma3();
    let mut e = Engine::new(model, EngineConfig::default(), tok.stop_ids().to_vec()).unwrap();
    e.add(
        engine::RequestId(0),
        tok.encode(prompt).unwrap(),
        SamplingParams::greedy(8),
    )
    .unwrap();
    let want = tok
        .decode(&e.run_to_completion().unwrap()[&engine::RequestId(0)], true)
        .unwrap();
    drop(e);
    let body = json!({"model": gemma, "prompt": prompt, "max_tokens": 8, "temperature": 0});
    let (status, v) = post_json(front.http, "/v1/completions", &body);
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"][0]["text"], want.as_str(), "{v}");
    assert_eq!(v["model"], gemma);
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let mut r = request(
        front.http,
        "POST",
        "/v1/completions",
        "application/json",
        &streamed.to_string(),
    )
    .unwrap();
    assert_eq!(r.status, 200);
    let mut text = String::new();
    while let Some((_, data)) = r.next_event() {
        if data == "[DONE]" {
            break;
        }
        let v: Value = serde_json::from_str(&data).unwrap();
        text += v["choices"][0]["text"].as_str().unwrap_or("");
    }
    assert_eq!(text, want);
    // The front's own model still answers; the chat goes to SmolLM2, not forwarded.
    let chat =
        json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4});
    let (status, v) = post_json(front.http, "/v1/chat/completions", &chat);
    assert_eq!(status, 200, "{v}");
    let ok = r#"tandem_router_requests_total{outcome="ok"}"#;
    assert_eq!(
        metric_at(g.operator, ok),
        2.0,
        "the Gemma router served both Gemma requests"
    );
    let forwarded = format!("tandem_router_forwarded_total{{model=\"{gemma}\"}}");
    assert_eq!(metric_at(front.operator, &forwarded), 2.0);
    assert_eq!(
        metric_at(front.operator, ok),
        1.0,
        "the front served its own model's one"
    );
    let ids = tandem_tests::cluster::model_ids(front.http);
    assert_eq!(ids, [MODEL, gemma]);
    let (status, v) = post_json(
        front.http,
        "/v1/completions",
        &json!({"model": "llama-9", "prompt": "x"}),
    );
    assert_eq!(status, 404, "{v}");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(msg.contains(MODEL) && msg.contains(gemma), "{msg}");
}
