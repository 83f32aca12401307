//! Sampling controls through a real cluster (issue 15): router, prefill and decode workers as
//! processes on loopback. The decode worker applies them: the answers are the engine's own run
//! with the same parameters, and the KV went through the prefill pool (asserted from the
//! workers' transfer counts).

use engine::{Engine, EngineConfig, SamplingParams};
use serde_json::json;
use tandem_tests::cluster::{post_json, Cluster};
use tandem_tests::load_model;

const EXE: &str = env!("CARGO_BIN_EXE_tandem");

#[test]
fn logit_bias_and_penalties_through_a_cluster_are_the_engines() {
    let c = Cluster::start(EXE.as_ref(), 1, 1);
    let (model, tok) = load_model();
    let prompt = tok
        .encode("Count from one to twenty in words: one, two, three,")
        .unwrap();
    let engine = |p: SamplingParams| {
        let mut e = Engine::new(
            model.clone(),
            EngineConfig::default(),
            tok.stop_ids().to_vec(),
        )
        .unwrap();
        e.add(0, prompt.clone(), p).unwrap();
        e.run_to_completion().unwrap().remove(&0).unwrap()
    };
    let ask = |extra: serde_json::Value| {
        let mut body = json!({"prompt": prompt, "max_tokens": 12, "temperature": 0});
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        let (status, v) = post_json(c.http, "/v1/completions", &body);
        assert_eq!(status, 200, "{v}");
        v["choices"][0]["text"].as_str().unwrap().to_string()
    };
    // A bias of 100 on one token: the whole answer is that token.
    let forced = tok.encode(" banana").unwrap()[0];
    let text = ask(json!({"logit_bias": {forced.to_string(): 100}}));
    assert_eq!(text, tok.decode(&[forced; 12], true).unwrap());
    // Penalties and min_p at a temperature, seeded: the engine's tokens exactly.
    let p = SamplingParams {
        temperature: 0.8,
        seed: 7,
        presence_penalty: 0.6,
        frequency_penalty: 0.4,
        repetition_penalty: 1.2,
        min_p: 0.05,
        min_tokens: 4,
        ..SamplingParams::greedy(12)
    };
    let text = ask(
        json!({"temperature": 0.8, "seed": 7, "presence_penalty": 0.6,
        "frequency_penalty": 0.4, "repetition_penalty": 1.2, "min_p": 0.05, "min_tokens": 4}),
    );
    assert_eq!(text, tok.decode(&engine(p.clone()), true).unwrap());
    let plain = engine(SamplingParams {
        temperature: 0.8,
        seed: 7,
        ..SamplingParams::greedy(12)
    });
    assert_ne!(engine(p), plain, "the penalties change this answer");
    c.wait_transfers("tcp", 2);
    c.wait_all_free(std::time::Duration::from_secs(5));
}
