//! The `tandem` command line: `up` starts the cluster of cluster.toml; `router`, `prefill` and
//! `decode` start one role each; `generate` runs the engine in-process; `model fetch`,
//! `model path` and `model list` manage the model cache; `bench engine` measures prefill/decode
//! throughput, `bench load` puts an open-loop load on an OpenAI endpoint; `simulate` runs the
//! cluster of cluster.toml on a virtual clock; `status` shows a running cluster's pools and
//! workers; `plan` finds the cheapest static fleets that meet latency targets, by simulation;
//! `pki` makes the cluster's certificates for a deployment.

mod bench_speculate;
mod cluster;
mod download;
mod load;
mod pki;
mod plan;
mod plot;
mod profile;
mod simulate;
mod status;
mod store;
mod supervise;

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use engine::text::{StopStrings, StreamDecoder};
use engine::{ChatMessage, Engine, EngineConfig, SamplingParams};

#[derive(Parser)]
#[command(
    name = "tandem",
    version,
    about = "tandem: prefill/decode disaggregated LLM serving"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Start the router and both worker pools of cluster.toml as separate processes.
    Up {
        /// The cluster description.
        #[arg(long, default_value = "cluster.toml")]
        config: PathBuf,
    },
    /// Run the router (OpenAI-compatible HTTP, control plane).
    Router(cluster::RoleArgs),
    /// Run a prefill worker.
    Prefill(cluster::RoleArgs),
    /// Run a decode worker.
    Decode(cluster::RoleArgs),
    /// Run a node of the cluster KV store (`[store]`).
    Store(cluster::RoleArgs),
    /// Generate text from a prompt, streamed to stdout.
    Generate(GenerateArgs),
    /// Manage the model cache.
    #[command(subcommand)]
    Model(ModelCmd),
    /// Benchmarks.
    #[command(subcommand)]
    Bench(BenchCmd),
    /// Simulate the cluster of cluster.toml on a virtual clock under a load (mock engines).
    Simulate(simulate::SimulateArgs),
    /// A running cluster's pools and workers, from its router (the status page as a table).
    Status(status::StatusArgs),
    /// The cheapest static fleets that meet TTFT and ITL targets under a load, against the
    /// planner (by simulation).
    Plan(plan::PlanArgs),
    /// The cluster's certificates for a deployment (`tandem up` makes its own).
    #[command(subcommand)]
    Pki(pki::PkiCmd),
}

#[derive(Subcommand)]
enum ModelCmd {
    /// Download a known model (default: SmolLM2-135M-Instruct Q4_1) into the cache if missing,
    /// checking its SHA-256; prints its path.
    Fetch {
        /// Which (`tandem model list`).
        #[arg(long, default_value = "smollm2-135m")]
        model: String,
    },
    /// Print a known model's path in the cache (the default model's honours `TANDEM_MODEL`).
    Path {
        /// Which (`tandem model list`).
        #[arg(long, default_value = "smollm2-135m")]
        model: String,
    },
    /// The models `fetch` knows.
    List,
}

#[derive(Subcommand)]
enum BenchCmd {
    /// Prefill and decode throughput of the engine on one machine.
    Engine(BenchArgs),
    /// Open-loop load (Poisson or a replayed Mooncake trace) against an OpenAI endpoint.
    Load(load::LoadArgs),
}

#[derive(Args)]
struct ModelArgs {
    /// A .gguf file or a Hugging Face model directory (default: the cached SmolLM2-135M-Instruct).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Where the forward pass runs: `cpu`, or `cuda:N` (needs a build with `--features cuda`).
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Worker threads for the kernels (default: all cores).
    #[arg(long)]
    threads: Option<usize>,
}

#[derive(Args)]
struct GenerateArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Raw prompt text, fed to the model as is.
    #[arg(long, conflicts_with = "chat", required_unless_present = "chat")]
    prompt: Option<String>,
    /// A user message, rendered through the model's chat template.
    #[arg(long)]
    chat: Option<String>,
    /// Most tokens to generate.
    #[arg(long, default_value_t = 256)]
    max_tokens: usize,
    /// Sampling temperature (0 = greedy).
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Nucleus sampling threshold.
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// Keep only the k most likely tokens (0 = all).
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Random seed.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Stop when this text is generated (repeatable).
    #[arg(long)]
    stop: Vec<String>,
}

#[derive(Args)]
struct BenchArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Prompt length for the prefill measurement.
    #[arg(long, default_value_t = 512)]
    prompt_len: usize,
    /// Decode batch sizes to measure.
    #[arg(long, value_delimiter = ',', default_value = "1,16")]
    batch: Vec<usize>,
    /// Decode steps per measurement.
    #[arg(long, default_value_t = 64)]
    steps: usize,
    /// Repetitions (the best is reported).
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Measure prompt-lookup speculative decoding against plain decoding instead (copying and
    /// chat prompts at batch 1, a mixed batch of 16; `--steps` tokens a prompt).
    #[arg(long)]
    speculate: bool,
    /// With `--speculate`: most drafts a step verifies.
    #[arg(long, default_value_t = 8)]
    drafts: usize,
}

fn main() -> Result<()> {
    ::store::keep_freed_memory();
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    match Cli::parse().cmd {
        Cmd::Up { config } => cluster::up(config),
        Cmd::Router(a) => cluster::router(a),
        Cmd::Prefill(a) => cluster::prefill(a),
        Cmd::Decode(a) => cluster::decode(a),
        Cmd::Store(a) => store::run(a),
        Cmd::Generate(a) => generate(a),
        Cmd::Model(m) => model(m),
        Cmd::Bench(BenchCmd::Engine(a)) => bench(a),
        Cmd::Bench(BenchCmd::Load(a)) => load::run(a),
        Cmd::Simulate(a) => simulate::run(a),
        Cmd::Status(a) => status::run(a),
        Cmd::Plan(a) => plan::run(a),
        Cmd::Pki(c) => pki::run(c),
    }
}

fn model(cmd: ModelCmd) -> Result<()> {
    use engine::fetch;
    match cmd {
        ModelCmd::Fetch { model } if model == fetch::DEFAULT.name => {
            println!(
                "{}",
                fetch::ensure_default_model_with(&download::download)?.display()
            )
        }
        ModelCmd::Fetch { model } => {
            let m = fetch::known(&model)?;
            println!("{}", fetch::ensure_with(m, &download::download)?.display())
        }
        ModelCmd::Path { model } if model == fetch::DEFAULT.name => {
            println!("{}", fetch::default_model_path().display())
        }
        ModelCmd::Path { model } => {
            let m = fetch::known(&model)?;
            println!("{}", fetch::cache_dir().join(m.file).display())
        }
        ModelCmd::List => {
            for m in fetch::KNOWN {
                println!("{:<14} {}", m.name, m.about);
            }
        }
    }
    Ok(())
}

fn load(args: &ModelArgs) -> Result<(Arc<engine::Model>, engine::Tokenizer)> {
    if let Some(t) = args.threads {
        kernels::set_threads(t).context("setting the thread count")?;
    }
    let path = match &args.model {
        Some(p) => p.clone(),
        None => engine::fetch::ensure_default_model_with(&crate::download::download)?,
    };
    let t0 = Instant::now();
    let device = kernels::Device::parse(&args.device)
        .with_context(|| format!("--device {}", args.device))?;
    let (model, tok) = engine::load(&path, device)?;
    eprintln!(
        "tandem: loaded {} ({} layers, {}) from {} in {:.2}s",
        model.config.name,
        model.config.n_layers,
        model.device_name(),
        path.display(),
        t0.elapsed().as_secs_f64()
    );
    Ok((Arc::new(model), tok))
}

fn generate(a: GenerateArgs) -> Result<()> {
    let (model, tok) = load(&a.model)?;
    let text = match (&a.prompt, &a.chat) {
        (Some(p), _) => p.clone(),
        (None, Some(c)) => tok.apply_chat_template(&[ChatMessage::user(c)], true)?,
        (None, None) => bail!("give --prompt or --chat"),
    };
    let ids = tok.encode(&text)?;
    let params = SamplingParams {
        max_tokens: Some(a.max_tokens),
        temperature: a.temperature,
        top_p: a.top_p,
        top_k: a.top_k,
        seed: a.seed,
        ..Default::default()
    };
    let blocks = (ids.len() + a.max_tokens).div_ceil(16) + 1;
    let cfg = EngineConfig {
        num_blocks: blocks,
        ..Default::default()
    };
    let mut engine = Engine::new(model, cfg, tok.stop_ids().to_vec())?;
    engine.add(engine::RequestId(0), ids.clone(), params)?;
    let mut dec = StreamDecoder::default();
    let mut stops = StopStrings::new(&a.stop);
    let mut out = std::io::stdout().lock();
    let t0 = Instant::now();
    let (mut n, mut first) = (0usize, None);
    'run: while engine.has_work() {
        for ev in engine.step()? {
            n += 1;
            first.get_or_insert_with(|| t0.elapsed());
            if ev.finish == Some(engine::FinishReason::Stop) && tok.stop_ids().contains(&ev.token) {
                break 'run;
            }
            let (text, stopped) = stops.push(&dec.push(&tok, ev.token)?);
            out.write_all(text.as_bytes())?;
            out.flush()?;
            if stopped {
                engine.release(engine::RequestId(0), engine::Release::Cancelled);
                break 'run;
            }
        }
    }
    out.write_all(stops.flush().as_bytes())?;
    writeln!(out)?;
    let total = t0.elapsed().as_secs_f64();
    let ttft = first.map_or(0.0, |d| d.as_secs_f64());
    eprintln!(
        "tandem: {} prompt tokens, {n} generated; first token {:.0} ms, {:.1} tokens/s after it",
        ids.len(),
        ttft * 1e3,
        (n.saturating_sub(1)) as f64 / (total - ttft).max(1e-9)
    );
    Ok(())
}

fn bench(a: BenchArgs) -> Result<()> {
    if a.speculate {
        let (model, tok) = load(&a.model)?;
        return bench_speculate::run_bench(model, tok, a.steps.max(128), a.drafts);
    }
    let (model, _) = load(&a.model)?;
    let threads = kernels::threads();
    let vocab = model.config.vocab_size as u32;
    // The prompt, and at least the 40 tokens the decode contexts below are cut from.
    let prompt: Vec<u32> = (0..a.prompt_len.max(40) as u32)
        .map(|i| (i * 7919 + 101) % vocab)
        .collect();
    let bs = 16;
    let max_b = a.batch.iter().copied().max().unwrap_or(1);
    let per_seq = (a.prompt_len.max(32) + a.steps).div_ceil(bs) + 1;
    let mut kv = model.new_kv_cache(bs, per_seq * max_b.max(1))?;
    println!(
        "model: {}  device: {}  threads: {threads}",
        model.config.name,
        model.device_name()
    );
    let weight_bytes = model.weights().map_or(0, |w| w.bytes_per_token()) as f64;
    let probe = BandwidthProbe::new();
    let bw = probe.measure();
    println!(
        "weights read per decoded token: {:.1} MB",
        weight_bytes / 1e6
    );
    println!(
        "memory read bandwidth ({threads} threads): {:.1} GB/s -> batch-1 decode limit {:.1} tokens/s",
        bw / 1e9,
        bw / weight_bytes
    );
    // Prefill: one chunk of the whole prompt.
    let mut best = f64::MAX;
    for _ in 0..a.reps {
        let mut table = engine::BlockTable::default();
        kv.reserve(&mut table, a.prompt_len)?;
        let t0 = Instant::now();
        let chunk = engine::SeqChunk {
            tokens: &prompt[..a.prompt_len],
            start_pos: 0,
            block_table: &table,
            logits: engine::Logits::Last,
        };
        model.forward(&mut kv, &[chunk])?;
        best = best.min(t0.elapsed().as_secs_f64());
        kv.release(table);
    }
    println!(
        "prefill {} tokens: {:.1} tokens/s ({:.1} ms)",
        a.prompt_len,
        a.prompt_len as f64 / best,
        best * 1e3
    );
    // Decode: `b` sequences with a 32-token context each, one token per sequence per step.
    for &b in &a.batch {
        let mut best = f64::MAX;
        // Batch 1: each repetition's speed over the limit measured just before it, since this
        // machine's bandwidth moves between runs.
        let mut shares = Vec::new();
        for _ in 0..a.reps {
            let limit = (b == 1).then(|| probe.measure() / weight_bytes);
            let mut tables = Vec::new();
            for s in 0..b {
                let mut t = engine::BlockTable::default();
                kv.reserve(&mut t, 32 + a.steps)?;
                let p = &prompt[s % 8..s % 8 + 32];
                model.forward(
                    &mut kv,
                    &[engine::SeqChunk {
                        tokens: p,
                        start_pos: 0,
                        block_table: &t,
                        logits: engine::Logits::None,
                    }],
                )?;
                tables.push(t);
            }
            let t0 = Instant::now();
            for step in 0..a.steps {
                let toks: Vec<u32> = (0..b as u32)
                    .map(|s| (s * 31 + step as u32 * 17 + 5) % vocab)
                    .collect();
                let chunks: Vec<engine::SeqChunk<'_>> = tables
                    .iter()
                    .zip(&toks)
                    .map(|(t, tok)| engine::SeqChunk {
                        tokens: std::slice::from_ref(tok),
                        start_pos: 32 + step,
                        block_table: t,
                        logits: engine::Logits::Last,
                    })
                    .collect();
                model.forward(&mut kv, &chunks)?;
            }
            let secs = t0.elapsed().as_secs_f64();
            best = best.min(secs);
            if let Some(limit) = limit {
                shares.push(100.0 * a.steps as f64 / secs / limit);
            }
            tables.into_iter().for_each(|t| kv.release(t));
        }
        let tps = (b * a.steps) as f64 / best;
        shares.sort_by(f64::total_cmp);
        let limit = match shares.as_slice() {
            [] => String::new(),
            s => format!(
                ", {:.0}% of the memory limit measured before it (median of {}; {:.0}-{:.0}%)",
                s[s.len() / 2],
                s.len(),
                s[0],
                s[s.len() - 1]
            ),
        };
        println!(
            "decode batch {b}: {tps:.1} tokens/s ({:.2} ms/step{limit})",
            best * 1e3 / a.steps as f64
        );
    }
    Ok(())
}

/// Measures the bytes per second the kernel pool's threads read from memory together: a
/// parallel sum over a 1 GiB buffer, far larger than the caches.
struct BandwidthProbe {
    buf: kernels::mem::HugeBuf<u64>,
}

impl BandwidthProbe {
    fn new() -> BandwidthProbe {
        // In huge pages, as the weights and the KV cache are (kernels::mem): the limit is what
        // the same memory gives a plain sequential read.
        let mut buf = kernels::mem::HugeBuf::zeroed(1 << 27);
        buf.iter_mut().enumerate().for_each(|(i, v)| *v = i as u64);
        BandwidthProbe { buf }
    }

    /// The best of 3 passes.
    fn measure(&self) -> f64 {
        use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
        let mut best = f64::MAX;
        for _ in 0..3 {
            let t0 = Instant::now();
            let sum = AtomicU64::new(0);
            let chunks: Vec<&[u64]> = self.buf.chunks(1 << 16).collect();
            kernels::for_each(chunks.len(), |i| {
                let s = chunks[i].iter().fold(0u64, |a, v| a.wrapping_add(*v));
                sum.fetch_add(s, Relaxed);
            });
            let sum = sum.into_inner();
            best = best.min(t0.elapsed().as_secs_f64());
            std::hint::black_box(sum);
        }
        (self.buf.len() * 8) as f64 / best
    }
}
