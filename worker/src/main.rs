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
    /// Turn text into token shards (GPT-2's BPE or a Hugging Face tokenizer.json), or a folder of
    /// images in torchvision's ImageFolder layout into onnxSamples shards; both split into
    /// train/ and val/ under --output.
    PrepareData {
        /// Text: plain files (a document each), JSON Lines (`.jsonl`, a document per line, in
        /// --text-field) or Parquet (`.parquet`, a document per row, in the --text-field column).
        #[arg(long, num_args = 1.., required_unless_present = "images", conflicts_with = "images")]
        input: Vec<PathBuf>,
        /// A folder with a subfolder of images per class (torchvision's ImageFolder).
        #[arg(long)]
        images: Option<PathBuf>,
        #[arg(long)]
        output: PathBuf,
        /// Share of the tokens (text) or of each class's images kept for validation.
        #[arg(long, default_value_t = 0.1)]
        val_fraction: f64,
        /// `gpt2` (GPT-2's BPE, built in) or the path of a Hugging Face tokenizer.json.
        #[arg(long, default_value = "gpt2")]
        tokenizer: String,
        /// The JSON field or Parquet column that holds each document's text.
        #[arg(long, default_value = "text")]
        text_field: String,
        /// Images: the side of the square tensors (shorter side resized to it, then center-cropped).
        #[arg(long, default_value_t = 224)]
        image_size: u32,
        /// Images: the graph inputs the image [3, size, size] and its class label [] feed.
        #[arg(long, default_value = "input")]
        image_input: String,
        #[arg(long, default_value = "labels")]
        label_input: String,
        /// Images: per-channel mean and standard deviation subtracted and divided after scaling to
        /// [0, 1] (ImageNet's: --mean 0.485,0.456,0.406 --std 0.229,0.224,0.225).
        // Three values each, checked by the handler: clap's num_args = 3 counts "a,b,c" as one.
        #[arg(long, value_delimiter = ',', default_values_t = [0.0, 0.0, 0.0])]
        mean: Vec<f32>,
        #[arg(long, value_delimiter = ',', default_values_t = [1.0, 1.0, 1.0])]
        std: Vec<f32>,
        /// Images: the seed of the train/val split and of the samples' order in the shards.
        #[arg(long, default_value_t = 0)]
        seed: u64,
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
            let c = &manifest.config;
            let origin = format!("checkpoint {}", dir.display());
            export::check_trained(&model, &weights, &c.weights_to_train, &c.frozen_weights, &origin)?;
            export::write(&model, &weights, &output)?;
            println!("exported step {} of {} to {}", manifest.step, dir.display(), output.display());
            Ok(())
        }
        Command::PrepareData {
            input,
            images,
            output,
            val_fraction,
            tokenizer,
            text_field,
            image_size,
            image_input,
            label_input,
            mean,
            std,
            seed,
        } => {
            if !(0.0..1.0).contains(&val_fraction) {
                return Err(Error::Config(format!("--val-fraction {val_fraction}: must be in [0, 1)")));
            }
            match images {
                Some(folder) => {
                    let per_channel = |flag: &str, v: &[f32]| {
                        <[f32; 3]>::try_from(v).map_err(|_| {
                            Error::Config(format!("--{flag} {v:?}: needs 3 values, one per channel (R,G,B)"))
                        })
                    };
                    let (mean, std) = (per_channel("mean", &mean)?, per_channel("std", &std)?);
                    if let Some(s) = std.iter().find(|s| !s.is_finite() || **s <= 0.0) {
                        return Err(Error::Config(format!("--std {s}: each channel's must be positive")));
                    }
                    if let Some(m) = mean.iter().find(|m| !m.is_finite()) {
                        return Err(Error::Config(format!("--mean {m}: each channel's must be finite")));
                    }
                    if image_size == 0 {
                        return Err(Error::Config("--image-size 0: must be positive".into()));
                    }
                    let opts = prepare::ImageOptions {
                        size: image_size,
                        input_name: image_input,
                        label_name: label_input,
                        mean,
                        std,
                        val_fraction,
                        seed,
                    };
                    prepare::prepare_images(&folder, &output, &opts)
                }
                None => {
                    let opts = prepare::TextOptions { tokenizer, text_field, val_fraction };
                    prepare::prepare_text(&input, &output, &opts)
                }
            }
        }
        Command::Inspect { path, dims } => inspect::inspect(&path, &dims),
    }
}

fn main() {
    let cli = Cli::parse();
    // Rust ignores SIGPIPE, so a print to a closed pipe (`inspect MODEL | head -1`) would panic;
    // for the commands a person pipes, the default action ends the process quietly, as it ends
    // other Unix tools. `train` keeps the exit codes the operator reads.
    if matches!(cli.command, Command::Inspect { .. } | Command::PrepareData { .. }) {
        // SAFETY: signal() with SIG_DFL installs no handler; nothing else has touched SIGPIPE.
        unsafe {
            libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        }
    }
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
