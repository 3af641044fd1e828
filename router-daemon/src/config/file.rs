//! The TOML configuration file of `kv-router serve`, layered under environment
//! variables and flags: **file < environment < command line**, then validated once
//! into the typed [`super::DaemonConfig`] (whose sub-configs belong to their
//! crates: `indexer::IndexerConfig`, `scheduler::SchedulerConfig` and its policy
//! variant, NATS, etcd, HTTP).
//!
//! Every setting exists three ways, derived from one declaration (the clap flag):
//!
//! | flag | environment | TOML |
//! |---|---|---|
//! | `--nats-url` | `KV_ROUTER_NATS_URL` | `[nats] url` |
//! | `--etcd-connect-timeout-ms` | `KV_ROUTER_ETCD_CONNECT_TIMEOUT_MS` | `[etcd] connect-timeout-ms` |
//! | `--overlap-weight` | `KV_ROUTER_OVERLAP_WEIGHT` | `[scheduler] overlap-weight` |
//!
//! The TOML table is the flag's help heading, lowercased (`NATS` → `[nats]`); the key
//! is the flag's long name without the `{table}-` prefix. The file's values become the
//! flags' defaults before clap parses the command line, so clap's own precedence
//! (command line, then environment, then default) gives exactly the layering above.
//! Unknown keys and values the flag would refuse are errors naming the key and file.
//!
//! `kv-router config print` renders the effective settings back as TOML (loadable with
//! `--config`), each annotated with where its value came from; `kv-router config
//! reference` renders the Markdown table of `docs/configuration.md`, which a test
//! keeps identical to the flags.

use clap::parser::ValueSource;
use clap::{Arg, ArgAction, ArgMatches, Command};
use std::collections::BTreeMap;
use std::ffi::OsString;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// The flag naming the configuration file, and its environment variable.
pub const CONFIG_FLAG: &str = "config";
/// Environment variable of [`CONFIG_FLAG`].
pub const CONFIG_ENV: &str = "KV_ROUTER_CONFIG";

/// Errors reading a configuration file.
#[derive(Debug, thiserror::Error)]
pub enum ConfigFileError {
    /// The file cannot be read.
    #[error("cannot read config file {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The file is not valid TOML.
    #[error("config file {path} is not valid toml: {message}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// The parser's message.
        message: String,
    },
    /// A key names no setting.
    #[error("unknown setting `{key}` in config file {path}")]
    UnknownKey {
        /// The file.
        path: PathBuf,
        /// The dotted key.
        key: String,
    },
    /// A value the setting refuses (wrong type, out of range, not a list, ...).
    #[error("invalid value for `{key}` (--{flag}) in config file {path}: {reason}")]
    BadValue {
        /// The file.
        path: PathBuf,
        /// The dotted key.
        key: String,
        /// The flag the key stands for.
        flag: String,
        /// What is wrong, lowercase.
        reason: String,
    },
}

/// Whether `arg` is a setting (not help, version or the config file flag itself).
fn is_setting(arg: &Arg) -> bool {
    arg.get_long().is_some()
        && arg.get_id() != CONFIG_FLAG
        && !matches!(
            arg.get_action(),
            ArgAction::Help | ArgAction::HelpShort | ArgAction::HelpLong | ArgAction::Version
        )
}

/// The TOML table of `arg` (`None`: top level) and its key in that table.
pub fn toml_key(arg: &Arg) -> (Option<String>, String) {
    let long = arg.get_long().unwrap_or_default();
    match arg.get_help_heading() {
        Some(heading) => {
            let table = heading.to_ascii_lowercase().replace(' ', "-");
            let key = long
                .strip_prefix(&format!("{table}-"))
                .unwrap_or(long)
                .to_owned();
            (Some(table), key)
        }
        None => (None, long.to_owned()),
    }
}

fn dotted(table: &Option<String>, key: &str) -> String {
    match table {
        Some(t) => format!("{t}.{key}"),
        None => key.to_owned(),
    }
}

fn is_flag(arg: &Arg) -> bool {
    matches!(arg.get_action(), ArgAction::SetTrue | ArgAction::SetFalse)
}

fn is_multiple(arg: &Arg) -> bool {
    arg.get_value_delimiter().is_some()
        || matches!(arg.get_action(), ArgAction::Append)
        || arg.get_num_args().is_some_and(|n| n.max_values() > 1)
}

/// The configuration file named by `--config PATH`, `--config=PATH` or
/// `KV_ROUTER_CONFIG` (the flag wins), found before clap parses the command line.
pub fn locate(argv: &[OsString]) -> Option<PathBuf> {
    let flag = format!("--{CONFIG_FLAG}");
    let prefix = format!("{flag}=");
    let mut args = argv.iter();
    while let Some(a) = args.next() {
        let s = a.to_string_lossy();
        if s == "--" {
            break;
        }
        if s == flag {
            return args.next().map(PathBuf::from);
        }
        if let Some(path) = s.strip_prefix(&prefix) {
            return Some(PathBuf::from(path));
        }
    }
    std::env::var_os(CONFIG_ENV)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
}

/// `command` with the configuration file named in `argv` (if any, see [`locate`])
/// applied to the `serve`-like subcommands at `paths` (e.g. `&[&["serve"],
/// &["config", "print"]]`), the file checked against `settings` (use
/// [`super::serve_command`]).
///
/// # Errors
/// [`ConfigFileError`] when the file cannot be read or has a bad key or value.
pub fn with_config_file(
    command: Command,
    settings: &Command,
    argv: &[OsString],
    paths: &[&[&str]],
) -> Result<(Command, Option<ConfigFile>), ConfigFileError> {
    let Some(path) = locate(argv) else {
        return Ok((command, None));
    };
    let file = ConfigFile::load(&path, settings)?;
    fn apply_at(command: Command, path: &[&str], file: &ConfigFile) -> Command {
        match path.split_first() {
            None => file.apply(command),
            Some((name, rest)) => command.mut_subcommand(*name, |sub| apply_at(sub, rest, file)),
        }
    }
    let command = paths
        .iter()
        .fold(command, |command, path| apply_at(command, path, &file));
    Ok((command, Some(file)))
}

/// A loaded configuration file: values by setting (clap argument id).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigFile {
    path: PathBuf,
    values: BTreeMap<String, Vec<String>>,
}

impl ConfigFile {
    /// Reads and checks `path` against the settings of `command` (use
    /// [`super::serve_command`]).
    ///
    /// # Errors
    /// [`ConfigFileError`] naming the file and the first bad key.
    pub fn load(path: &Path, command: &Command) -> Result<Self, ConfigFileError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigFileError::Read {
            path: path.to_owned(),
            source,
        })?;
        Self::parse(path, &text, command)
    }

    /// Checks TOML `text` (read from `path`) against the settings of `command`.
    ///
    /// # Errors
    /// As [`ConfigFile::load`].
    pub fn parse(path: &Path, text: &str, command: &Command) -> Result<Self, ConfigFileError> {
        let table: toml::Table =
            text.parse()
                .map_err(|e: toml::de::Error| ConfigFileError::Parse {
                    path: path.to_owned(),
                    message: e.message().to_owned(),
                })?;
        let mut by_key: BTreeMap<String, &Arg> = BTreeMap::new();
        for arg in command.get_arguments().filter(|a| is_setting(a)) {
            let (table, key) = toml_key(arg);
            by_key.insert(dotted(&table, &key), arg);
        }
        let mut flat: Vec<(String, &toml::Value)> = Vec::new();
        for (key, value) in &table {
            match value {
                toml::Value::Table(inner) => {
                    flat.extend(inner.iter().map(|(k, v)| (format!("{key}.{k}"), v)));
                }
                other => flat.push((key.clone(), other)),
            }
        }
        let mut values = BTreeMap::new();
        for (key, value) in flat {
            let arg = by_key
                .get(&key)
                .ok_or_else(|| ConfigFileError::UnknownKey {
                    path: path.to_owned(),
                    key: key.clone(),
                })?;
            let bad = |reason: String| ConfigFileError::BadValue {
                path: path.to_owned(),
                key: key.clone(),
                flag: arg.get_long().unwrap_or_default().to_owned(),
                reason,
            };
            let strings = scalar_strings(value).map_err(bad)?;
            if strings.len() != 1 && !is_multiple(arg) {
                return Err(bad("expects a single value, not a list".to_owned()));
            }
            check_value(arg, &strings).map_err(bad)?;
            values.insert(arg.get_id().to_string(), strings);
        }
        Ok(Self {
            path: path.to_owned(),
            values,
        })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Makes the file's values the defaults of `command`'s settings, so that the
    /// environment and the command line still override them.
    pub fn apply(&self, command: Command) -> Command {
        let mut command = command;
        for (id, values) in &self.values {
            let values = values.clone();
            command = command.mut_arg(id.as_str(), move |arg| {
                arg.default_values(values.iter().map(|v| clap::builder::OsStr::from(v.clone())))
            });
        }
        command
    }
}

/// A TOML value as the strings clap would get on a command line.
fn scalar_strings(value: &toml::Value) -> Result<Vec<String>, String> {
    let one = |v: &toml::Value| match v {
        toml::Value::String(s) => Ok(s.clone()),
        toml::Value::Integer(i) => Ok(i.to_string()),
        toml::Value::Float(f) => Ok(f.to_string()),
        toml::Value::Boolean(b) => Ok(b.to_string()),
        toml::Value::Datetime(d) => Ok(d.to_string()),
        toml::Value::Array(_) | toml::Value::Table(_) => {
            Err("nested lists and tables are not settings".to_owned())
        }
    };
    match value {
        toml::Value::Array(items) => items.iter().map(one).collect(),
        other => one(other).map(|s| vec![s]),
    }
}

/// Runs `arg`'s own parser over `values`, as if they were given on the command line.
fn check_value(arg: &Arg, values: &[String]) -> Result<(), String> {
    if is_flag(arg) {
        return match values {
            [v] if v == "true" || v == "false" => Ok(()),
            _ => Err("expects true or false".to_owned()),
        };
    }
    let probe = arg
        .clone()
        .env(None::<&str>)
        .required(false)
        .default_values(Vec::<clap::builder::OsStr>::new());
    let long = format!("--{}", arg.get_long().unwrap_or_default());
    let mut argv = vec![OsString::from("check")];
    for v in values {
        argv.push(OsString::from(&long));
        argv.push(OsString::from(v));
    }
    Command::new("check")
        .arg(probe)
        .try_get_matches_from(argv)
        .map(|_| ())
        .map_err(|e| {
            let rendered = e.render().to_string();
            rendered
                .lines()
                .next()
                .unwrap_or_default()
                .trim_start_matches("error: ")
                .to_owned()
        })
}

/// Renders a TOML value for `raw`: numbers and booleans bare, everything else quoted.
fn toml_literal(raw: &str) -> String {
    if raw == "true" || raw == "false" || raw.parse::<i64>().is_ok() {
        return raw.to_owned();
    }
    if raw.parse::<f64>().is_ok_and(f64::is_finite) && raw.contains('.') {
        return raw.to_owned();
    }
    toml::Value::String(raw.to_owned()).to_string()
}

fn source_note(source: Option<ValueSource>, arg: &Arg, file: Option<&ConfigFile>) -> String {
    match source {
        Some(ValueSource::CommandLine) => "command line".to_owned(),
        Some(ValueSource::EnvVariable) => format!(
            "environment {}",
            arg.get_env()
                .map(|e| e.to_string_lossy())
                .unwrap_or_default()
        ),
        Some(ValueSource::DefaultValue) => match file {
            Some(f) if f.values.contains_key(arg.get_id().as_str()) => {
                format!("config file {}", f.path.display())
            }
            _ => "default".to_owned(),
        },
        _ => "unset".to_owned(),
    }
}

/// Groups the settings of `command` by TOML table, in declaration order.
fn tables(command: &Command) -> Vec<(Option<String>, Vec<&Arg>)> {
    let mut out: Vec<(Option<String>, Vec<&Arg>)> = Vec::new();
    for arg in command.get_arguments().filter(|a| is_setting(a)) {
        let (table, _) = toml_key(arg);
        match out.iter_mut().find(|(t, _)| *t == table) {
            Some((_, args)) => args.push(arg),
            None => out.push((table, vec![arg])),
        }
    }
    // Top-level keys must come before the first table in TOML.
    out.sort_by_key(|(t, _)| t.is_some());
    out
}

/// The effective settings of a parsed `serve` (or `config print`) command line as
/// TOML, each with a comment saying where its value came from (`file` is the config
/// file that was applied, if any). Secret values (`--nats-token`, `--nats-password`)
/// are replaced by `<redacted>`.
pub fn effective_toml(
    command: &Command,
    matches: &ArgMatches,
    file: Option<&ConfigFile>,
) -> String {
    let mut out =
        String::from("# Effective kv-router configuration (file < environment < command line).\n");
    for (table, args) in tables(command) {
        if let Some(t) = &table {
            let _ = write!(out, "\n[{t}]\n");
        }
        for arg in args {
            let (_, key) = toml_key(arg);
            let id = arg.get_id().as_str();
            let raw: Option<Vec<String>> = matches
                .get_raw(id)
                .map(|vs| vs.map(|v| v.to_string_lossy().into_owned()).collect());
            let note = source_note(matches.value_source(id), arg, file);
            match raw {
                None => {
                    let _ = writeln!(out, "# {key} =   (unset)");
                }
                Some(_) if arg.is_hide_env_values_set() => {
                    let _ = writeln!(out, "{key} = \"<redacted>\"   # {note}");
                }
                Some(values) if is_multiple(arg) => {
                    let items: Vec<String> = values.iter().map(|v| toml_literal(v)).collect();
                    let _ = writeln!(out, "{key} = [{}]   # {note}", items.join(", "));
                }
                Some(values) => {
                    let value = values.first().map(|v| toml_literal(v)).unwrap_or_default();
                    let _ = writeln!(out, "{key} = {value}   # {note}");
                }
            }
        }
    }
    out
}

/// One line of help text, Markdown-table safe.
fn help_line(arg: &Arg) -> String {
    arg.get_long_help()
        .or_else(|| arg.get_help())
        .map(|h| h.to_string())
        .unwrap_or_default()
        .replace('\n', " ")
        .replace('|', "\\|")
}

/// The configuration reference: one Markdown table per TOML table, with each
/// setting's key, flag, environment variable, default and description.
pub fn reference_markdown(command: &Command) -> String {
    let mut out = String::new();
    for (table, args) in tables(command) {
        let title = match &table {
            Some(t) => format!("`[{t}]`"),
            None => "top level".to_owned(),
        };
        let _ = write!(
            out,
            "### {title}\n\n| key | flag | environment | default | description |\n|---|---|---|---|---|\n"
        );
        for arg in args {
            let (_, key) = toml_key(arg);
            let env = arg
                .get_env()
                .map(|e| format!("`{}`", e.to_string_lossy()))
                .unwrap_or_default();
            let defaults: Vec<String> = arg
                .get_default_values()
                .iter()
                .map(|v| v.to_string_lossy().into_owned())
                .collect();
            let default = if defaults.is_empty() && is_flag(arg) {
                "`false`".to_owned()
            } else if defaults.is_empty() {
                "—".to_owned()
            } else {
                format!("`{}`", defaults.join(","))
            };
            let _ = writeln!(
                out,
                "| `{key}` | `--{}` | {env} | {default} | {} |",
                arg.get_long().unwrap_or_default(),
                help_line(arg)
            );
        }
        out.push('\n');
    }
    out
}
