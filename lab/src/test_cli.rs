//! The `kv-mocker lab` command line as the studies' tests parse it.

use crate::{LabArgs, LabCommand};
use clap::Parser;

#[derive(Debug, Parser)]
struct Cli {
    #[command(flatten)]
    lab: LabArgs,
}

/// `kv-mocker lab <study> <args…>` parsed, and the study's subcommand taken out by
/// `take` (which panics naming the study when the subcommand is another).
pub(crate) fn parse_study<T>(
    study: &str,
    args: &[&str],
    take: impl FnOnce(Option<LabCommand>) -> T,
) -> Result<T, clap::Error> {
    let words = ["lab", study].into_iter().chain(args.iter().copied());
    Cli::try_parse_from(words).map(|cli| take(cli.lab.command))
}
