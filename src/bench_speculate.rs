//! `tandem bench engine --speculate`: decode speed with prompt-lookup speculation against
//! without, in one run, through the engine's own scheduler — prompts whose answers copy from
//! their context (repeat, quote, rename a variable, fill a template) and ordinary chat prompts,
//! each at batch 1 with the two arms alternating prompt by prompt, then a batch of 16.

use std::sync::Arc;
use std::time::Instant;

use anyhow::{ensure, Result};
use engine::{ChatMessage, Engine, EngineConfig, Model, RequestId, SamplingParams, Tokenizer};

const PASSAGES: [&str; 8] = [
    "The committee will meet on the third Thursday of every month in room 204, starting at ten o'clock. Members who cannot attend should send their apologies to the secretary by the Tuesday before.",
    "def total_price(items, tax_rate):\n    subtotal = 0\n    for item in items:\n        subtotal += item.price * item.quantity\n    return subtotal * (1 + tax_rate)",
    "Once upon a time there was a small village at the edge of a great forest. Every morning the baker opened his shop, and every evening the children ran home before the lights went out.",
    "function renderList(items) {\n  const list = document.createElement('ul');\n  for (const item of items) {\n    const li = document.createElement('li');\n    li.textContent = item.name;\n    list.appendChild(li);\n  }\n  return list;\n}",
    "Water boils at one hundred degrees Celsius at sea level. At higher altitudes the air pressure is lower, so water boils at a lower temperature and food takes longer to cook.",
    "SELECT customers.name, orders.total FROM customers JOIN orders ON orders.customer_id = customers.id WHERE orders.total > 100 ORDER BY orders.total DESC;",
    "Please remember to lock the front door, turn off the lights in the kitchen, feed the cat twice a day, and water the plants on the balcony every other morning.",
    "struct Point {\n    x: f64,\n    y: f64,\n}\n\nimpl Point {\n    fn distance(&self, other: &Point) -> f64 {\n        ((self.x - other.x).powi(2) + (self.y - other.y).powi(2)).sqrt()\n    }\n}",
];

const CHAT: [&str; 20] = [
    "Write a short poem about the sea.",
    "What is the capital of France, and what is it known for?",
    "Explain photosynthesis in simple words.",
    "Give me three tips for learning to cook.",
    "Why is the sky blue?",
    "Describe a cat to someone who has never seen one.",
    "What are prime numbers? Give some examples.",
    "Tell me a short story about a robot who learns to paint.",
    "How do airplanes stay in the air?",
    "What should I pack for a weekend at the beach?",
    "How does a bicycle work?",
    "Suggest a few good names for a puppy.",
    "What is the difference between weather and climate?",
    "Write a haiku about rain.",
    "Explain what a computer does.",
    "What are some healthy breakfast ideas?",
    "Why do leaves change colour in autumn?",
    "How can I get better sleep?",
    "What is the water cycle?",
    "Give me ideas for a rainy day at home.",
];

/// Prompts whose answers copy from their context: each passage repeated, quoted, edited and
/// filled into a template (24).
fn copy_prompts() -> Vec<String> {
    PASSAGES
        .iter()
        .enumerate()
        .flat_map(|(i, p)| {
            let edit = if p.contains('(') || p.contains('{') {
                format!("Rename every variable called `item` to `entry` in this code and output the whole code:\n\n{p}")
            } else {
                format!("Copy this text, replacing every \"the\" with \"THE\":\n\n{p}")
            };
            [
                format!("Repeat the following text exactly, word for word:\n\n{p}"),
                format!("Quote this back to me verbatim:\n\n\"{p}\""),
                if i % 2 == 0 {
                    edit
                } else {
                    format!("Fill in the form and output it whole.\nForm:\nName: ____\nNote: {p}\nSigned: ____\nUse the name Alice Smith.")
                },
            ]
        })
        .collect()
}

/// One prompt's run: tokens, and decode seconds (first token to last).
struct Run {
    tokens: Vec<u32>,
    decode_secs: f64,
}

fn engine(model: &Arc<Model>, tok: &Tokenizer) -> Result<Engine> {
    let cfg = EngineConfig {
        num_blocks: 2048,
        ..Default::default()
    };
    Ok(Engine::new(model.clone(), cfg, tok.stop_ids().to_vec())?)
}

/// `prompts` run together through `e` (greedy, `max` tokens, `drafts` at most), each one's
/// tokens and decode time.
fn run(e: &mut Engine, prompts: &[Vec<u32>], max: usize, drafts: usize) -> Result<Vec<Run>> {
    let mut first = vec![None; prompts.len()];
    let mut runs: Vec<Run> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let params = SamplingParams {
                speculation: Some(drafts),
                ..SamplingParams::greedy(max)
            };
            e.add(RequestId(i as u64), p.clone(), params)?;
            Ok(Run {
                tokens: Vec::new(),
                decode_secs: 0.0,
            })
        })
        .collect::<Result<_>>()?;
    while e.has_work() {
        let events = e.step()?;
        let now = Instant::now();
        for ev in events {
            let i = ev.id.0 as usize;
            let t0 = *first[i].get_or_insert(now);
            runs[i].tokens.push(ev.token);
            runs[i].decode_secs = (now - t0).as_secs_f64();
        }
    }
    Ok(runs)
}

/// Decode tokens per second over `runs` (each run's tokens after its first).
fn rate(runs: &[Run]) -> f64 {
    let toks: usize = runs.iter().map(|r| r.tokens.len().saturating_sub(1)).sum();
    toks as f64 / runs.iter().map(|r| r.decode_secs).sum::<f64>().max(1e-9)
}

/// The prompt set at batch 1, the arms alternating prompt by prompt: (without, with) rates.
fn batch_one(
    model: &Arc<Model>,
    tok: &Tokenizer,
    name: &str,
    set: &[Vec<u32>],
    max: usize,
    drafts: usize,
) -> Result<()> {
    let (mut off, mut on) = (Vec::new(), Vec::new());
    let mut e = engine(model, tok)?;
    let before = e.load().speculation;
    for p in set {
        off.extend(run(&mut e, std::slice::from_ref(p), max, 0)?);
        on.extend(run(&mut e, std::slice::from_ref(p), max, drafts)?);
    }
    let same = off
        .iter()
        .zip(&on)
        .filter(|(a, b)| a.tokens == b.tokens)
        .count();
    ensure!(
        same == set.len(),
        "{name}: {same} of {} outputs identical",
        set.len()
    );
    let s = e.load().speculation;
    let (proposed, accepted, verifies, declined) = (
        s.proposed - before.proposed,
        s.accepted - before.accepted,
        s.verifies - before.verifies,
        s.declined - before.declined,
    );
    let tokens: usize = on.iter().map(|r| r.tokens.len()).sum();
    let (a, b) = (rate(&off), rate(&on));
    println!(
        "{name}, batch 1, {} prompts: {a:.1} tokens/s without, {b:.1} with speculation: {:.2}x; drafts accepted {accepted} of {proposed} ({:.0}%), {:.2} a verify step; {tokens} tokens: {verifies} verify steps, {} plain, {declined} proposals declined; outputs identical {same} of {same}",
        set.len(),
        b / a,
        100.0 * accepted as f64 / proposed.max(1) as f64,
        accepted as f64 / verifies.max(1) as f64,
        tokens as u64 - accepted - verifies,
    );
    Ok(())
}

/// The bench: `drafts` at most a step, `max` tokens a prompt.
pub fn run_bench(model: Arc<Model>, tok: Tokenizer, max: usize, drafts: usize) -> Result<()> {
    let render = |text: &str| -> Result<Vec<u32>> {
        let t = match tok.apply_chat_template(&[ChatMessage::user(text)], true) {
            Ok(t) => t,
            // A base model (no template): the raw text.
            Err(_) => format!("{text}\n\n"),
        };
        Ok(tok.encode(&t)?)
    };
    let copy: Vec<Vec<u32>> = copy_prompts()
        .iter()
        .map(|p| render(p))
        .collect::<Result<_>>()?;
    let chat: Vec<Vec<u32>> = CHAT.iter().map(|p| render(p)).collect::<Result<_>>()?;
    println!(
        "speculation: prompt lookup, at most {drafts} drafts a step; {max} tokens a prompt, greedy"
    );
    batch_one(&model, &tok, "copying prompts", &copy, max, drafts)?;
    batch_one(&model, &tok, "chat prompts", &chat, max, drafts)?;
    // Batch 16: half copying, half chat, all at once.
    let mixed: Vec<Vec<u32>> = copy
        .iter()
        .take(8)
        .chain(chat.iter().take(8))
        .cloned()
        .collect();
    let mut e = engine(&model, &tok)?;
    let mut total = |drafts| -> Result<(f64, Vec<Vec<u32>>)> {
        let t0 = Instant::now();
        let runs = run(&mut e, &mixed, max, drafts)?;
        let n: usize = runs.iter().map(|r| r.tokens.len()).sum();
        Ok((
            n as f64 / t0.elapsed().as_secs_f64(),
            runs.into_iter().map(|r| r.tokens).collect(),
        ))
    };
    let (a, ta) = total(0)?;
    let (b, tb) = total(drafts)?;
    let (a2, _) = total(0)?;
    let (b2, _) = total(drafts)?;
    ensure!(ta == tb, "batch 16: outputs differ with speculation");
    println!(
        "mixed batch of 16: {:.1} output tokens/s without, {:.1} with speculation: {:.2}x (two rounds, alternated: {a:.1}/{b:.1}, {a2:.1}/{b2:.1}); outputs identical",
        (a + a2) / 2.0,
        (b + b2) / 2.0,
        (b + b2) / (a + a2)
    );
    Ok(())
}
