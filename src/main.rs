//! The `egress-proxies-operator` binary: one subcommand per job. Errors become `anyhow`
//! reports here, at the edge, and nowhere else.

use std::{path::PathBuf, process::ExitCode};

use anyhow::Context;
use clap::{Parser, Subcommand};
use egress_proxies_operator::{
    api,
    check::{Checker, Report},
    config::ProvidersConfig,
    machine,
};

/// Provisions, health-checks and leases egress proxies.
#[derive(Parser)]
#[command(name = "egress-proxies-operator", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Print the CustomResourceDefinitions (Proxy, ProviderHealth) as YAML.
    Crd {
        /// Write one file per CRD into this folder (e.g. config/crd/bases) instead of printing.
        #[arg(long, value_name = "DIR")]
        out_dir: Option<PathBuf>,
    },
    /// Validate Proxy manifests and providers configs offline, as the API server would.
    Check {
        /// Files to validate; each may hold several YAML documents.
        #[arg(required = true, value_name = "FILE")]
        files: Vec<PathBuf>,
        /// Also require every Proxy's spec.provider to name an instance of this providers config.
        #[arg(long, value_name = "FILE")]
        providers_config: Option<PathBuf>,
    },
    /// Print the lifecycle tables as Markdown with Mermaid diagrams (docs/machines.md).
    Machines {
        /// Compare with docs/machines.md in the current directory instead; fail if it differs.
        #[arg(long)]
        check: bool,
    },
    /// Replay a lifecycle scenario file (e.g. machines/scenarios/*.yaml) and print its audit trail.
    Audit {
        /// The scenario file.
        #[arg(value_name = "SCENARIO")]
        scenario: PathBuf,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli.command) {
        Ok(code) => code,
        Err(err) => {
            eprintln!("error: {err:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(command: Command) -> anyhow::Result<ExitCode> {
    match command {
        Command::Crd { out_dir: None } => {
            print!("{}", api::render_all()?);
            Ok(ExitCode::SUCCESS)
        }
        Command::Crd { out_dir: Some(dir) } => {
            std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
            for file in api::crd_files()? {
                let path = dir.join(&file.file_name);
                std::fs::write(&path, file.yaml).with_context(|| format!("writing {}", path.display()))?;
                eprintln!("wrote {}", path.display());
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Check {
            files,
            providers_config,
        } => {
            let providers = providers_config
                .as_deref()
                .map(ProvidersConfig::load)
                .transpose()?;
            let checker = Checker::new(providers);
            let mut report = Report::default();
            for file in &files {
                checker.check_file(file, &mut report);
            }
            for problem in &report.problems {
                println!("{problem}");
            }
            if report.problems.is_empty() {
                eprintln!("{} document(s) in {} file(s): ok", report.documents, files.len());
                Ok(ExitCode::SUCCESS)
            } else {
                eprintln!(
                    "{} problem(s) in {} document(s) of {} file(s)",
                    report.problems.len(),
                    report.documents,
                    files.len()
                );
                Ok(ExitCode::FAILURE)
            }
        }
        Command::Machines { check: false } => {
            print!("{}", machine::docs::render_markdown());
            Ok(ExitCode::SUCCESS)
        }
        Command::Machines { check: true } => {
            let path = std::path::Path::new(machine::docs::DOC_PATH);
            machine::docs::check_markdown(path)?;
            eprintln!("{} is up to date", path.display());
            Ok(ExitCode::SUCCESS)
        }
        Command::Audit { scenario } => {
            print!("{}", machine::scenario::replay_file(&scenario)?);
            Ok(ExitCode::SUCCESS)
        }
    }
}
