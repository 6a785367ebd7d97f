//! `tensorfleet-worker`: train, export, prepare-data, inspect. Exit codes: 0 done, 2 bad
//! configuration or input or a model with operators the engine does not run, 3 unreadable or
//! corrupt data/model/checkpoint, 1 anything else.

use clap::{Parser, Subcommand};
use std::path::PathBuf;
use tensorfleet_worker::config::TrainingConfig;
use tensorfleet_worker::error::{Error, Result};
use tensorfleet_worker::monitor::console::ConsoleMode;
use tensorfleet_worker::{checkpoint, export, inspect, models, prepare, runner};

#[derive(Parser)]
#[command(
    name = "tensorfleet-worker",
    version,
    about = "Trains ONNX graphs: the rank program of a tensorfleet TrainingJob"
)]
struct Cli {
    /// text, or json for one JSON object per log line (log collectors); json also replaces
    /// the progress bar with per-step log lines.
    #[arg(long, global = true, default_value = "text", value_parser = ["text", "json"])]
    log_format: String,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Train the model a configuration file describes.
    Train {
        #[arg(long)]
        config: PathBuf,
        /// Override a key: --set optimizer.lr=3e-4 (repeatable).
        #[arg(long = "set", value_name = "KEY.PATH=VALUE")]
        set: Vec<String>,
        /// No per-step output (no progress bar, no step log lines).
        #[arg(long)]
        quiet: bool,
    },
    /// Write the inference model of a checkpoint.
    Export {
        #[arg(long)]
        checkpoint: PathBuf,
        #[arg(long)]
        output: PathBuf,
    },
    /// Tokenize text files with the GPT-2 BPE into token shards.
    PrepareData {
        #[arg(long, num_args = 1.., required = true)]
        input: Vec<PathBuf>,
        #[arg(long)]
        output: PathBuf,
        /// Share of the tokens kept for validation.
        #[arg(long, default_value_t = 0.1)]
        val_fraction: f64,
    },
    /// Describe a checkpoint, an ONNX model or a data shard.
    Inspect {
        path: PathBuf,
        /// Sizes of symbolic dimensions, for the memory plan: --dim batch=8.
        #[arg(long = "dim", value_name = "NAME=SIZE")]
        dims: Vec<String>,
    },
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Train { config, set, quiet } => {
            let cfg = TrainingConfig::load(&config, &set)?;
            let console = match (quiet, cli.log_format.as_str()) {
                (true, _) => ConsoleMode::Quiet,
                (false, "json") => ConsoleMode::Log,
                (false, _) => ConsoleMode::Auto,
            };
            let s = runner::train(&cfg, console)?;
            if s.start_step == s.steps {
                println!("nothing to train: the newest checkpoint is at step {} of {}", s.start_step, s.steps);
            } else if s.start_step > 0 {
                let (from, to) = (s.start_step, s.steps);
                println!("resumed at step {from}, trained to {to}: loss {:.4} -> {:.4}", s.first_loss, s.final_loss);
            } else {
                println!("trained {} steps: loss {:.4} -> {:.4}", s.steps, s.first_loss, s.final_loss);
            }
            println!("  losses:      {}", s.metrics.display());
            match &s.checkpoints {
                Some(c) => println!("  checkpoints: {}", c.display()),
                None => println!("  checkpoints: none (checkpoint.every is 0)"),
            }
            println!("  model:       {}", s.model.display());
            if cfg.logging.tensorboard {
                println!("  tensorboard: tensorboard --logdir {}", cfg.tensorboard_dir().display());
            }
            Ok(())
        }
        Command::Export { checkpoint: dir, output } => {
            let (manifest, weights) = checkpoint::load(&dir)?;
            let model = models::load(&manifest.config.model, manifest.config.seed)?;
            export::write(&model, &weights, &output)?;
            println!("exported step {} of {} to {}", manifest.step, dir.display(), output.display());
            Ok(())
        }
        Command::PrepareData { input, output, val_fraction } => {
            if !(0.0..1.0).contains(&val_fraction) {
                return Err(Error::Config(format!("--val-fraction {val_fraction}: must be in [0, 1)")));
            }
            prepare::prepare(&input, &output, val_fraction)
        }
        Command::Inspect { path, dims } => inspect::inspect(&path, &dims),
    }
}

fn main() {
    let cli = Cli::parse();
    let logs = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("TENSORFLEET_LOG").unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        // Colour codes only for a person at a terminal, not in pod logs or files.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    match cli.log_format.as_str() {
        "json" => logs.json().init(),
        _ => logs.init(),
    }
    if let Err(e) = run(cli) {
        eprintln!("error: {e}");
        std::process::exit(e.exit_code());
    }
}
