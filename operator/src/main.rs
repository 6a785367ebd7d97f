//! `tensorfleet-operator`: the Kubernetes controller for `TrainingJob`s.
//!
//! Only the command line exists so far; the controller, the CRD types and `crdgen` arrive with
//! issue 3.

use std::process::ExitCode;

const USAGE: &str = "\
usage: tensorfleet-operator [--help | --version]

The Kubernetes controller of tensorfleet: turns TrainingJob objects into MPI-launched
tensorfleet-worker pods. Not implemented yet: the controller arrives with issue 3.";

#[derive(Debug, PartialEq, Eq)]
enum Command {
    Run,
    Help,
    Version,
}

/// Reads the arguments after the program name; an unknown one is returned as the error.
fn parse(args: impl IntoIterator<Item = String>) -> Result<Command, String> {
    let mut command = Command::Run;
    for arg in args {
        command = match arg.as_str() {
            "-h" | "--help" => Command::Help,
            "-V" | "--version" => Command::Version,
            _ => return Err(arg),
        };
    }
    Ok(command)
}

fn main() -> ExitCode {
    match parse(std::env::args().skip(1)) {
        Ok(Command::Help) => {
            println!("{USAGE}");
            ExitCode::SUCCESS
        }
        Ok(Command::Version) => {
            println!("tensorfleet-operator {}", env!("CARGO_PKG_VERSION"));
            ExitCode::SUCCESS
        }
        // Exits non-zero so that a deployment of this build fails visibly instead of idling.
        Ok(Command::Run) => {
            eprintln!("tensorfleet-operator: the controller is not implemented yet; it arrives with issue 3");
            ExitCode::FAILURE
        }
        Err(arg) => {
            eprintln!("tensorfleet-operator: unknown argument '{arg}'\n\n{USAGE}");
            ExitCode::from(2)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn no_arguments_runs_the_controller() {
        assert_eq!(parse(args(&[])), Ok(Command::Run));
    }

    #[test]
    fn help_and_version_are_recognised() {
        assert_eq!(parse(args(&["--help"])), Ok(Command::Help));
        assert_eq!(parse(args(&["-h"])), Ok(Command::Help));
        assert_eq!(parse(args(&["--version"])), Ok(Command::Version));
        assert_eq!(parse(args(&["-V"])), Ok(Command::Version));
    }

    #[test]
    fn an_unknown_argument_is_named() {
        assert_eq!(parse(args(&["--help", "--kubeconfig"])), Err("--kubeconfig".to_string()));
    }
}
