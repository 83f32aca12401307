//! Speculative decoding through a disaggregated cluster of the real engine (issue 37): the
//! decode pool speculates (`[decode] speculation = 8`), prefill is unchanged, and streams whose
//! answers copy from their prompts give exactly the tokens of the engine decoding without
//! speculation — greedy and seeded, including a stream moved live to another decode worker in
//! the middle of it. The path is asserted from the workers' counters: drafts were proposed and
//! accepted before and after the move, the KV moved, nothing was computed again.

use std::time::Duration;

use engine::SamplingParams;
use serde_json::json;
use tandem_tests::cluster::{metric_at, metric_sum, request, Cluster};

const EXE: &str = env!("CARGO_BIN_EXE_tandem");
const MODEL: &str = "SmolLM2-135M-Instruct.Q4_1";

const PASSAGE: &str = "The committee will meet on the third Thursday of every month in room 204, starting at ten o'clock. Members who cannot attend should send their apologies to the secretary by the Tuesday before.";

#[test]
fn speculating_streams_are_exact_through_the_cluster_and_across_a_live_move() {
    let mut c = Cluster::of(1, 2)
        .pools(["", "speculation = 8"])
        .start(EXE.as_ref());
    let n = 160;
    let message =
        format!("Repeat the following text exactly, word for word, three times:\n\n{PASSAGE}");
    let cases = [
        (
            json!({"temperature": 0, "max_tokens": n, "ignore_eos": true}),
            SamplingParams {
                ignore_eos: true,
                ..SamplingParams::greedy(n)
            },
        ),
        (
            json!({"temperature": 0.6, "top_p": 0.9, "seed": 11, "max_tokens": n, "ignore_eos": true}),
            SamplingParams {
                max_tokens: Some(n),
                temperature: 0.6,
                top_p: 0.9,
                seed: 11,
                ignore_eos: true,
                ..Default::default()
            },
        ),
    ];
    // Without the cluster and without speculation: the engine alone, the default (off).
    let want: Vec<String> = cases
        .iter()
        .map(|(_, p)| tandem_tests::engine_chat(&message, p.clone()).0)
        .collect();
    // Straight through: exact, and the decode worker speculated.
    for (k, (params, _)) in cases.iter().enumerate() {
        let text = c.open_chat(MODEL, &message, params).read_chunks(usize::MAX);
        assert_eq!(text, want[k], "stream {k} unmoved");
    }
    let accepted = metric_sum(c.operator, "tandem_worker_spec_accepted");
    let proposed = metric_sum(c.operator, "tandem_worker_spec_proposed");
    eprintln!("unmoved: drafts accepted {accepted} of {proposed}");
    assert!(
        accepted > 0.0 && proposed >= accepted,
        "{accepted} of {proposed}"
    );
    // A request may turn it off (the engine's own test shows it then drafts nothing); a value
    // past the cap is refused with an OpenAI error.
    let off = json!({"temperature": 0, "max_tokens": 16, "speculation": 0});
    assert!(!c
        .open_chat(MODEL, &message, &off)
        .read_chunks(usize::MAX)
        .is_empty());
    let bad =
        json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "speculation": 17});
    let r = request(
        c.http,
        "POST",
        "/v1/chat/completions",
        "application/json",
        &bad.to_string(),
    )
    .unwrap();
    assert_eq!(r.status, 400);
    let body = r.body();
    assert!(
        body.contains("speculation must be between 0 and 16"),
        "{body}"
    );
    // Moved mid-speculation: the serving worker is sent SIGTERM after a few chunks.
    for (k, (params, _)) in cases.iter().enumerate() {
        let mut r = c.open_chat(MODEL, &message, params);
        let mut text = r.read_chunks(24);
        let drained = c.serving();
        let there = metric_at(
            c.operator,
            &format!("tandem_worker_spec_accepted{{worker=\"{drained}\",role=\"decode\"}}"),
        );
        c.signal_worker(&drained, libc::SIGTERM);
        text += &r.read_chunks(usize::MAX);
        assert_eq!(text, want[k], "stream {k} moved");
        assert!(c.wait_exit(&drained, Duration::from_secs(10)).success());
        let moves = metric_at(c.operator, "tandem_router_moves_total{why=\"draining\"}");
        assert_eq!(moves, (k + 1) as f64, "moved live");
        assert_eq!(metric_at(c.operator, "tandem_router_migrations_total"), 0.0);
        assert_eq!(
            metric_at(c.operator, "tandem_kv_transfer_failures_total"),
            0.0
        );
        eprintln!("stream {k}: {drained} had accepted {there} drafts when it was drained");
        let cfg = c.config(&Cluster::of(1, 1).pools(["", "speculation = 8"]));
        c.add_worker("decode", &format!("decode-new-{k}"), &cfg);
        c.wait_for(1, 2);
    }
    // The worker that took the streams over speculated on them too.
    assert!(metric_sum(c.operator, "tandem_worker_spec_accepted") > 0.0);
    c.wait_all_free(Duration::from_secs(10));
}
