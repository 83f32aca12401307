//! Sampling controls through a real cluster (issue 15): router, prefill and decode workers as
//! processes on loopback. The decode worker applies them: the answers are the engine's own run
//! with the same parameters, and the KV went through the prefill pool (asserted from the
//! workers' transfer counts).

use engine::{Engine, EngineConfig, SamplingParams};
use serde_json::{json, Value};
use tandem_tests::cluster::{metric_at, post_json, request, Cluster};
use tandem_tests::load_model;

const EXE: &str = env!("CARGO_BIN_EXE_tandem");
const MODEL: &str = "SmolLM2-135M-Instruct.Q4_1";

/// What the engine alone generates for `prompt` with `p`.
fn engine_run(
    model: &std::sync::Arc<engine::Model>,
    tok: &engine::Tokenizer,
    prompt: &[u32],
    p: SamplingParams,
) -> Vec<u32> {
    let stops = tok.stop_ids().to_vec();
    let mut e = Engine::new(model.clone(), EngineConfig::default(), stops).unwrap();
    e.add(engine::RequestId(0), prompt.to_vec(), p).unwrap();
    e.run_to_completion()
        .unwrap()
        .remove(&engine::RequestId(0))
        .unwrap()
}

#[test]
fn logit_bias_and_penalties_through_a_cluster_are_the_engines() {
    let c = Cluster::start(EXE.as_ref(), 1, 1);
    let (model, tok) = load_model();
    let prompt = tok
        .encode("Count from one to twenty in words: one, two, three,")
        .unwrap();
    let engine = |p: SamplingParams| engine_run(&model, &tok, &prompt, p);
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

/// The JSON chunks of a streamed response, up to `[DONE]`.
fn sse_events(c: &Cluster, path: &str, body: &Value) -> Vec<Value> {
    let mut r = request(c.http, "POST", path, "application/json", &body.to_string()).unwrap();
    assert_eq!(r.status, 200);
    let mut out = Vec::new();
    while let Some((name, data)) = r.next_event() {
        assert_eq!(name, "message", "{data}");
        if data == "[DONE]" {
            return out;
        }
        out.push(serde_json::from_str(&data).unwrap());
    }
    panic!("stream ended without [DONE]");
}

/// log-softmax of `logits` at `t`, in f64.
fn log_softmax(logits: &[f32], t: u32) -> f64 {
    let max = logits.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
    let z: f64 = logits.iter().map(|&v| (v as f64 - max).exp()).sum();
    logits[t as usize] as f64 - max - z.ln()
}

#[test]
fn logprobs_are_the_engines_log_softmax_in_both_formats_streamed_or_not() {
    let c = Cluster::start(EXE.as_ref(), 1, 1);
    let (model, tok) = load_model();
    let message = "Name three colours.";
    let text = tok
        .apply_chat_template(&[engine::ChatMessage::user(message)], true)
        .unwrap();
    let prompt = tok.encode(&text).unwrap();
    // The model's own logits, step by step, greedy.
    let pick = |l: &[f32], _: &[u32]| engine::sampler::argmax(l);
    let (tokens, logits) = tandem_tests::decode_by_hand(&model, &prompt, 16, tok.stop_ids(), pick);
    let n_text = tokens
        .iter()
        .filter(|t| !tok.stop_ids().contains(t))
        .count();
    let chat = json!({"messages": [{"role": "user", "content": message}], "max_tokens": 16,
        "temperature": 0, "logprobs": true, "top_logprobs": 3});
    let (status, v) = post_json(c.http, "/v1/chat/completions", &chat);
    assert_eq!(status, 200, "{v}");
    let content = v["choices"][0]["logprobs"]["content"]
        .as_array()
        .unwrap()
        .clone();
    assert_eq!(
        content.len(),
        n_text,
        "one entry per token of the text: {v}"
    );
    let mut joined = Vec::new();
    for (i, e) in content.iter().enumerate() {
        let want = log_softmax(&logits[i], tokens[i]);
        let got = e["logprob"].as_f64().unwrap();
        assert!(
            (got - want).abs() < 1e-4,
            "token {i}: {got} vs the engine's {want}"
        );
        let top = e["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3);
        assert_eq!(
            top[0]["logprob"], e["logprob"],
            "greedy: the top one was chosen"
        );
        assert!(top
            .windows(2)
            .all(|w| w[0]["logprob"].as_f64() >= w[1]["logprob"].as_f64()));
        joined.extend(
            e["bytes"]
                .as_array()
                .unwrap()
                .iter()
                .map(|b| b.as_u64().unwrap() as u8),
        );
    }
    let answer = v["choices"][0]["message"]["content"].as_str().unwrap();
    assert_eq!(
        String::from_utf8(joined).unwrap(),
        answer,
        "the entries' bytes make the text"
    );
    // Streamed: the chunks' entries are the same ones.
    let mut body = chat.clone();
    body["stream"] = json!(true);
    let events = sse_events(&c, "/v1/chat/completions", &body);
    let streamed: Vec<Value> = events
        .iter()
        .flat_map(|e| {
            e["choices"][0]["logprobs"]["content"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .collect();
    assert_eq!(streamed, content);
    // The legacy completions format, on the raw prompt.
    let body = json!({"prompt": prompt, "max_tokens": 16, "temperature": 0, "logprobs": 2});
    let (status, v) = post_json(c.http, "/v1/completions", &body);
    assert_eq!(status, 200, "{v}");
    let lp = &v["choices"][0]["logprobs"];
    let values = lp["token_logprobs"].as_array().unwrap();
    assert_eq!(values.len(), n_text);
    for (i, got) in values.iter().enumerate() {
        assert!((got.as_f64().unwrap() - log_softmax(&logits[i], tokens[i])).abs() < 1e-4);
    }
    let pieces: Vec<&str> = lp["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap())
        .collect();
    assert_eq!(pieces.concat(), v["choices"][0]["text"].as_str().unwrap());
    let offsets: Vec<u64> = lp["text_offset"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| o.as_u64().unwrap())
        .collect();
    assert!(
        offsets.windows(2).all(|w| w[0] <= w[1]) && offsets[0] == 0,
        "{offsets:?}"
    );
    assert!(lp["top_logprobs"]
        .as_array()
        .unwrap()
        .iter()
        .all(|m| m.as_object().unwrap().len() <= 2));
    c.wait_transfers("tcp", 3);
}

#[test]
fn the_official_openai_client_reads_logprobs_and_sends_bias_and_penalties() {
    let c = Cluster::start(EXE.as_ref(), 1, 1);
    let (_, tok) = load_model();
    let forced = tok.encode(" banana").unwrap()[0];
    let script = format!(
        r#"
import json, openai
client = openai.OpenAI(base_url="http://{http}/v1", api_key="unused")
msgs = [{{"role": "user", "content": "Name three colours."}}]
chat = client.chat.completions.create(model="{MODEL}", messages=msgs, temperature=0, max_tokens=8,
                                      logprobs=True, top_logprobs=2)
content = chat.choices[0].logprobs.content
comp = client.completions.create(model="{MODEL}", prompt="Red, green and", max_tokens=6, temperature=0,
                                 logprobs=1, extra_body={{"ignore_eos": True}})
forced = client.completions.create(model="{MODEL}", prompt="Fruit:", max_tokens=4, temperature=0,
                                   logit_bias={{"{forced}": 100}})
pen = client.completions.create(model="{MODEL}", prompt="Fruit:", max_tokens=8, temperature=0,
                                presence_penalty=1.0, frequency_penalty=0.5,
                                extra_body={{"repetition_penalty": 1.2, "min_p": 0.1}})
print(json.dumps({{
    "chat_text": chat.choices[0].message.content,
    "chat_tokens": [e.token for e in content],
    "chat_logprobs": [e.logprob for e in content],
    "chat_top": [len(e.top_logprobs) for e in content],
    "comp_logprobs": comp.choices[0].logprobs.token_logprobs,
    "forced": forced.choices[0].text,
    "pen": pen.choices[0].text,
}}))
"#,
        http = c.http
    );
    let v = tandem_tests::python_json(&script);
    let tokens: Vec<&str> = v["chat_tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap())
        .collect();
    assert_eq!(tokens.concat(), v["chat_text"].as_str().unwrap());
    let lps = v["chat_logprobs"].as_array().unwrap();
    assert!(
        !lps.is_empty() && lps.iter().all(|l| l.as_f64().unwrap() <= 0.0),
        "{v}"
    );
    assert!(
        v["chat_top"].as_array().unwrap().iter().all(|n| n == 2),
        "{v}"
    );
    assert_eq!(v["comp_logprobs"].as_array().unwrap().len(), 6, "{v}");
    assert_eq!(
        v["forced"].as_str().unwrap(),
        tok.decode(&[forced; 4], true).unwrap()
    );
    assert!(!v["pen"].as_str().unwrap().is_empty(), "{v}");
}

/// `echo` with `logprobs` through a disaggregated cluster and the official client: the prompt
/// comes back with each token's log-probability after the first — the model's own log-softmax at
/// that position (one forward over the prompt, here) — and the decode worker computed the prompt
/// itself: the router's decision by reason says so, and the request never entered Prefilling.
#[test]
fn echo_returns_the_prompts_logprobs_computed_on_the_decode_worker() {
    let c = Cluster::start(EXE.as_ref(), 1, 1);
    let (model, tok) = load_model();
    let text = "The quick brown fox jumps over the lazy dog.";
    let script = format!(
        r#"
import json, openai
client = openai.OpenAI(base_url="http://{http}/v1", api_key="unused")
r = client.completions.create(model="{MODEL}", prompt={text:?}, max_tokens=1, temperature=0,
                              logprobs=2, echo=True)
lp = r.choices[0].logprobs
print(json.dumps({{"text": r.choices[0].text, "tokens": lp.tokens, "values": lp.token_logprobs,
                  "top": lp.top_logprobs}}))
"#,
        http = c.http
    );
    let v = tandem_tests::python_json(&script);
    assert!(v["text"].as_str().unwrap().starts_with(text), "{v}");
    let prompt = tok.encode(text).unwrap();
    let rows = tandem_tests::prompt_rows(&model, &prompt);
    let values = v["values"].as_array().unwrap();
    assert_eq!(
        values.len(),
        prompt.len() + 1,
        "the prompt and one token: {v}"
    );
    assert!(values[0].is_null() && v["top"][0].is_null(), "{v}");
    let vocab = model.config.vocab_size;
    for (i, row) in rows.chunks_exact(vocab).enumerate().take(prompt.len() - 1) {
        let got = values[i + 1].as_f64().unwrap();
        let want = log_softmax(row, prompt[i + 1]);
        assert!(
            (got - want).abs() < 1e-4,
            "token {}: {got} vs {want}",
            i + 1
        );
        assert_eq!(v["top"][i + 1].as_object().unwrap().len(), 2, "{v}");
    }
    let label = router::core::PrefillDecision::LocalPromptLogprobs.label();
    let decided = format!("tandem_router_prefill_decisions_total{{decision=\"{label}\"}}");
    assert_eq!(metric_at(c.operator, &decided), 1.0);
    let prefilling = r#"tandem_router_request_phases_total{phase="prefilling"}"#;
    assert_eq!(
        metric_at(c.operator, prefilling),
        0.0,
        "no prefill worker was asked"
    );
}

/// Structured output through a disaggregated cluster and the official client: 20 chat answers
/// at temperature 1.0 with a `json_schema` response format all parse and validate (checked
/// field by field here) and end because the JSON is complete; `json_object` gives an object;
/// a schema that cannot compile is the client's 400, from the decode worker.
#[test]
fn json_schema_responses_parse_and_validate_through_the_official_client() {
    let c = Cluster::start(EXE.as_ref(), 1, 1);
    let schema = tandem_tests::structured::schema().to_string();
    let subjects = tandem_tests::structured::SUBJECTS;
    let script = format!(
        r#"
import json, openai
client = openai.OpenAI(base_url="http://{http}/v1", api_key="unused")
fmt = {{"type": "json_schema", "json_schema": {{"name": "person", "strict": True, "schema": json.loads({schema:?})}}}}
who = {subjects:?}
out = []
for i, w in enumerate(who):
    r = client.chat.completions.create(model="{MODEL}", temperature=1.0, seed=i, max_tokens=160,
        messages=[{{"role": "user", "content": f"Describe {{w}} as JSON."}}], response_format=fmt)
    out.append([r.choices[0].message.content, r.choices[0].finish_reason])
obj = client.chat.completions.create(model="{MODEL}", temperature=1.0, seed=1, max_tokens=160,
    messages=[{{"role": "user", "content": "A JSON object about cats."}}],
    response_format={{"type": "json_object"}})
try:
    client.chat.completions.create(model="{MODEL}", max_tokens=8,
        messages=[{{"role": "user", "content": "hi"}}],
        response_format={{"type": "json_schema", "json_schema": {{"name": "x",
                          "schema": {{"type": "object", "properties": {{"a": {{"type": "nonsense"}}}}}}}}}})
    bad = "accepted"
except openai.BadRequestError as e:
    bad = e.status_code
print(json.dumps({{"answers": out, "object": [obj.choices[0].message.content,
                  obj.choices[0].finish_reason], "bad": bad}}))
"#,
        http = c.http
    );
    let v = tandem_tests::python_json(&script);
    let answers = v["answers"].as_array().unwrap();
    assert_eq!(answers.len(), 20);
    for a in answers {
        let text = a[0].as_str().unwrap();
        let parsed: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {text}"));
        assert!(tandem_tests::structured::valid(&parsed), "{parsed}");
        assert_eq!(a[1], "stop", "{text}");
    }
    let obj: Value = serde_json::from_str(v["object"][0].as_str().unwrap()).unwrap();
    assert!(obj.is_object() && v["object"][1] == "stop", "{v}");
    assert_eq!(v["bad"], 400, "{v}");
}

/// `n = 3` through a disaggregated cluster and the official client, whole and streamed: choice
/// `i` is the engine's own run with `seed + i`; the other choices found the prompt's full blocks
/// in the decode worker's prefix cache (its live prefix-hit count), so the prompt was computed
/// once a request.
#[test]
fn n_choices_are_the_engines_runs_with_successive_seeds_sharing_the_prompt() {
    let c = Cluster::start(EXE.as_ref(), 1, 1);
    let (model, tok) = load_model();
    let text = "Once upon a time, in a small village by the sea, there lived an old fisherman who";
    let prompt = tok.encode(text).unwrap();
    let script = format!(
        r#"
import json, openai
client = openai.OpenAI(base_url="http://{http}/v1", api_key="unused")
r = client.completions.create(model="{MODEL}", prompt={text:?}, n=3, temperature=1.0, seed=5,
                              max_tokens=12, extra_body={{"ignore_eos": True}})
whole = {{c.index: c.text for c in r.choices}}
streamed = {{}}
for chunk in client.completions.create(model="{MODEL}", prompt={text:?}, n=3, temperature=1.0,
                                       seed=5, max_tokens=12, stream=True,
                                       extra_body={{"ignore_eos": True}}):
    for ch in chunk.choices:
        streamed[ch.index] = streamed.get(ch.index, "") + ch.text
print(json.dumps({{"whole": [whole[i] for i in range(3)], "streamed": [streamed[i] for i in range(3)],
                  "usage": r.usage.completion_tokens}}))
"#,
        http = c.http
    );
    let v = tandem_tests::python_json(&script);
    for i in 0..3 {
        let p = SamplingParams {
            temperature: 1.0,
            seed: 5 + i as u64,
            ignore_eos: true,
            ..SamplingParams::greedy(12)
        };
        let want = tok
            .decode(&engine_run(&model, &tok, &prompt, p), true)
            .unwrap();
        assert_eq!(v["whole"][i], want.as_str(), "choice {i}: {v}");
        assert_eq!(v["streamed"][i], want.as_str(), "choice {i} streamed: {v}");
    }
    assert_eq!(v["usage"], 36);
    assert_ne!(v["whole"][0], v["whole"][1], "the seeds differ");
    // Two requests, two followers each: each follower shares the prompt's full blocks.
    let full = (prompt.len() - 1) / 16 * 16;
    let hits: u64 = c
        .workers()
        .iter()
        .filter(|w| w["role"] == "decode")
        .map(|w| w["stats"]["prefix_hit_tokens"].as_u64().unwrap_or(0))
        .sum();
    assert!(
        full > 0 && hits >= 4 * full as u64,
        "{hits} hits, {full} a follower"
    );
    c.wait_all_free(std::time::Duration::from_secs(5));
}
