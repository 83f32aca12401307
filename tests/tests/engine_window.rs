//! Gemma 3's sliding-window layers keep only their window in the engine's KV cache: the pages
//! a long sequence holds, two long sequences in a cache that holds one without windows, the
//! prefix cache across the window, and a transfer that sends a windowed layer its window only
//! — each generating exactly what a cache keeping every token generates (the forward is
//! bitwise batch-invariant, so greedy tokens must match).

use engine::RequestId;
use engine::{Engine, EngineConfig, Model, SamplingParams};
use tandem_tests::{decode_by_hand, gemma3_golden, load_gemma3};

const PROMPT: usize = 1_200;
const NEW: usize = 16;
const BS: usize = 16;
const CHUNK: usize = 128;

fn argmax(l: &[f32], _: &[u32]) -> u32 {
    let mut best = 0;
    for (i, &x) in l.iter().enumerate() {
        if x > l[best] {
            best = i;
        }
    }
    best as u32
}

/// The first `n` tokens of the longest golden prompt, rotated by `turn` (another prompt of the
/// same length for every turn).
fn prompt(n: usize, turn: usize) -> Vec<u32> {
    let g = gemma3_golden();
    let long = g
        .cases
        .iter()
        .map(|c| &c.prompt_ids)
        .max_by_key(|p| p.len());
    let long = long.expect("golden cases");
    assert!(
        long.len() >= n + 1,
        "the longest golden prompt is shorter than {n}"
    );
    let mut p: Vec<u32> = long[1..].to_vec();
    p.rotate_left(turn * 37);
    let mut out = vec![long[0]]; // BOS first
    out.extend_from_slice(&p[..n - 1]);
    out
}

fn greedy() -> SamplingParams {
    SamplingParams {
        max_tokens: Some(NEW),
        temperature: 0.0,
        ignore_eos: true,
        ..Default::default()
    }
}

fn engine(model: &std::sync::Arc<Model>, num_blocks: usize) -> Engine {
    let config = EngineConfig {
        block_size: BS,
        num_blocks,
        max_batch_tokens: CHUNK,
        ..Default::default()
    };
    Engine::new(model.clone(), config, vec![]).unwrap()
}

/// The window, and the page groups of the model: (full groups, windowed groups).
fn shape(model: &Model) -> (usize, usize, usize) {
    let layers = &model.config.layers;
    let window = layers
        .iter()
        .find_map(|l| l.window)
        .expect("windowed layers");
    let global = layers.iter().filter(|l| l.window.is_none()).count();
    let windowed = layers.len() - global;
    // Gemma 3 270M: 3 global layers and 15 windowed ones → groups of 3.
    assert_eq!((global, windowed, window), (3, 15, 512));
    (window, 1, 5)
}

/// Pages a sequence holds once its first `c` tokens are computed: the full group's whole
/// reservation, each windowed group's blocks from the one holding the window's first key.
fn held(window: usize, windowed_groups: usize, c: usize) -> usize {
    let first_kept = (c + 1).saturating_sub(window) / BS;
    (PROMPT + NEW).div_ceil(BS) + windowed_groups * (c.div_ceil(BS) - first_kept)
}

#[test]
fn a_long_sequence_holds_its_window_and_generates_what_a_full_cache_does() {
    let (model, _) = load_gemma3();
    let (window, _, wg) = shape(&model);
    let p = prompt(PROMPT, 0);
    let (want, _) = decode_by_hand(&model, &p, NEW, &[], argmax);
    // 80 blocks of every layer's memory: 480 pages.
    let mut e = engine(&model, 80);
    assert_eq!(e.total_blocks(), 480);
    e.add(RequestId(1), p.clone(), greedy()).unwrap();
    let (mut got, mut steps) = (Vec::new(), 0);
    while e.has_work() {
        got.extend(e.step().unwrap().into_iter().map(|t| t.token));
        steps += 1;
        if !e.has_work() {
            break;
        }
        let computed = match got.len() {
            0 => (steps * CHUNK).min(PROMPT),
            n => PROMPT + n - 1,
        };
        assert_eq!(
            e.blocks_of(RequestId(1)),
            held(window, wg, computed),
            "pages held after step {steps} ({computed} tokens computed)"
        );
    }
    assert_eq!(
        got, want,
        "greedy tokens against a cache keeping every token"
    );
    assert_eq!(e.free_blocks(), e.total_blocks(), "every page back");
    // At the end 236 pages where every layer keeping every token holds 6 × 76 = 456.
    let full = 6 * (PROMPT + NEW).div_ceil(BS);
    assert_eq!((held(window, wg, PROMPT + NEW - 1), full), (236, 456));
}

#[test]
fn two_long_sequences_run_together_where_one_would_fill_a_full_cache() {
    let (model, _) = load_gemma3();
    shape(&model);
    // 95 blocks = 570 pages. A sequence of 1,216 tokens reserves 76 pages of the full group and
    // 41 of each windowed group's (its window and a chunk): 281; in every layer it would take
    // 6 × 76 = 456, and two would not fit.
    let mut e = engine(&model, 95);
    let ps = [prompt(PROMPT, 1), prompt(PROMPT, 2)];
    for (i, p) in ps.iter().enumerate() {
        e.add(RequestId(i as u64), p.clone(), greedy()).unwrap();
    }
    let mut got = [Vec::new(), Vec::new()];
    let mut together = 0;
    while e.has_work() {
        for t in e.step().unwrap() {
            got[t.id.0 as usize].push(t.token);
        }
        if e.load().running == 2 {
            together += 1;
        }
    }
    assert!(together > 0, "both sequences were running at once");
    for (i, p) in ps.iter().enumerate() {
        let (want, _) = decode_by_hand(&model, p, NEW, &[], argmax);
        assert_eq!(got[i], want, "sequence {i}");
    }
    assert_eq!(e.free_blocks(), e.total_blocks());
}

#[test]
fn the_prefix_cache_serves_a_windowed_layer_from_its_window() {
    let (model, _) = load_gemma3();
    shape(&model);
    let p = prompt(PROMPT, 3);
    let (want, _) = decode_by_hand(&model, &p, NEW, &[], argmax);
    let mut e = engine(&model, 120);
    for round in 0..2 {
        e.add(RequestId(round), p.clone(), greedy()).unwrap();
        let got = e
            .run_to_completion()
            .unwrap()
            .remove(&RequestId(round))
            .unwrap();
        assert_eq!(got, want, "round {round}");
    }
    // The second round found every whole block of its prompt but the last token's.
    let hit = (PROMPT - 1) / BS * BS;
    assert_eq!(e.load().prefix_hit_tokens, hit as u64);
    assert_eq!(e.free_blocks(), e.total_blocks());
}

#[test]
fn a_transfer_sends_a_windowed_layer_its_window_only() {
    let (model, _) = load_gemma3();
    let (window, _, _) = shape(&model);
    let p = prompt(PROMPT, 4);
    let (want, _) = decode_by_hand(&model, &p, NEW, &[], argmax);
    let mut prefill = engine(&model, 120);
    let mut decode = engine(&model, 120);
    let reserved = decode.reserve_remote(RequestId(7), p.clone(), greedy(), 0);
    assert_eq!(reserved.unwrap().cached, 0);
    prefill
        .add_prefill_only(RequestId(7), p[..p.len() - 1].to_vec(), 0, None)
        .unwrap();
    while prefill.take_prefilled().is_empty() {
        prefill.step().unwrap();
    }
    let kv = prefill.export_kv(RequestId(7)).unwrap();
    assert_eq!(prefill.free_blocks(), prefill.total_blocks());
    let width = model.config.kv_width();
    for (l, layer) in model.config.layers.iter().enumerate() {
        let tokens = match layer.window {
            None => PROMPT - 1,
            Some(_) => window - 1,
        };
        assert_eq!(kv[l].len(), 4 * tokens * width, "layer {l}'s bytes");
    }
    decode.admit_remote(RequestId(7), &kv).unwrap();
    let got = decode
        .run_to_completion()
        .unwrap()
        .remove(&RequestId(7))
        .unwrap();
    assert_eq!(got, want);
    assert_eq!(decode.free_blocks(), decode.total_blocks());
}
