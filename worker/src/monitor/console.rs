//! What a person watching a run sees. On a terminal: a progress bar with the latest loss,
//! learning rate and throughput. Anywhere else (a pod's log, a CI log): one structured
//! `tracing` line per logged step, which `--log-format json` turns into JSON.

use indicatif::{ProgressBar, ProgressStyle};
use std::io::IsTerminal;

/// What the caller asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConsoleMode {
    /// The bar on a terminal, log lines elsewhere.
    Auto,
    /// Log lines even on a terminal (structured logs were asked for).
    Log,
    /// No per-step output.
    Quiet,
}

pub enum Console {
    Bar(ProgressBar),
    Log,
    /// `--quiet`: no per-step output at all.
    Quiet,
}

/// One logged step, as the console shows it.
pub struct StepLine {
    pub step: u64,
    pub total: u64,
    pub loss: f64,
    pub lr: f64,
    pub grad_norm: f64,
    pub rate: f64,
    /// "tok" or "samples".
    pub unit: &'static str,
    pub mfu: Option<f64>,
}

impl Console {
    /// The bar when `mode` is Auto and stderr is a terminal.
    pub fn new(mode: ConsoleMode, start_step: u64, total: u64) -> Console {
        match mode {
            ConsoleMode::Quiet => return Console::Quiet,
            ConsoleMode::Log => return Console::Log,
            ConsoleMode::Auto if !std::io::stderr().is_terminal() => return Console::Log,
            ConsoleMode::Auto => {}
        }
        let bar = ProgressBar::new(total).with_position(start_step);
        let style =
            ProgressStyle::with_template("{bar:30.cyan/blue} {pos}/{len} [{elapsed_precise}<{eta_precise}] {msg}")
                .expect("a fixed, valid template")
                .progress_chars("=> ");
        bar.set_style(style);
        Console::Bar(bar)
    }

    pub fn step(&self, s: &StepLine) {
        match self {
            Console::Bar(bar) => {
                let mfu = s.mfu.map_or(String::new(), |m| format!(" | MFU {:.1}%", 100.0 * m));
                bar.set_message(format!("loss {:.4} | lr {:.2e} | {:.0} {}/s{mfu}", s.loss, s.lr, s.rate, s.unit));
                bar.set_position(s.step);
            }
            Console::Log => tracing::info!(
                step = s.step,
                total = s.total,
                loss = s.loss,
                lr = s.lr,
                grad_norm = s.grad_norm,
                rate = s.rate,
                unit = s.unit,
                mfu = s.mfu,
                "step"
            ),
            Console::Quiet => {}
        }
    }

    pub fn eval(&self, step: u64, loss: f64) {
        match self {
            Console::Bar(bar) => bar.println(format!("step {step}: eval loss {loss:.4}")),
            Console::Log => tracing::info!(step, eval_loss = loss, "evaluation"),
            Console::Quiet => {}
        }
    }

    /// Leaves the finished bar on screen.
    pub fn finish(&self) {
        if let Console::Bar(bar) = self {
            bar.finish();
        }
    }
}
