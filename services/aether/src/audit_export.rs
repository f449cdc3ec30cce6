//! `aether audit export`: asks a running service for an evidence bundle
//! (`POST /v1/audit/exports`, regulator token) and saves it, with progress on stderr while
//! the service collects events and proofs and while the bundle downloads. The export is
//! recorded on the service's `access/audit` stream like any other regulator query; the
//! saved file is then checked offline with `aether audit verify`.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, bail};
use clap::Args;
use serde_json::{Map, Value};

#[derive(Args, Debug)]
pub struct ExportArgs {
    /// The service's HTTP address.
    #[arg(long, env = "AETHER_URL", default_value = "http://127.0.0.1:8080")]
    pub url: String,
    /// A regulator token (prefer the environment: arguments are visible to other users).
    #[arg(long, env = "AETHER_TOKEN", hide_env_values = true)]
    pub token: String,
    /// A filter `key=value`, repeatable: from, to, event_type, stream_prefix, actor,
    /// trace_id, member, snapshot_id, request_id, limit (as `GET /v1/audit/events`), and
    /// since_tree_size (a checkpoint you hold, proven extended by the bundle).
    #[arg(long = "filter", value_name = "KEY=VALUE")]
    pub filters: Vec<String>,
    /// Where to write the bundle.
    #[arg(long, short = 'o', default_value = "aether-evidence.json")]
    pub output: PathBuf,
    /// No progress and no summary line.
    #[arg(long, short = 'q')]
    pub quiet: bool,
}

/// The filters as the export body: `{key: value}`.
fn filter_body(filters: &[String]) -> anyhow::Result<Map<String, Value>> {
    filters
        .iter()
        .map(|f| match f.split_once('=') {
            Some((k, v)) if !k.trim().is_empty() => {
                Ok((k.trim().to_owned(), Value::String(v.to_owned())))
            }
            _ => bail!("--filter {f:?} must be KEY=VALUE"),
        })
        .collect()
}

/// A spinner or bar on stderr; drawn only when stderr is a terminal (indicatif hides it
/// otherwise) and never with `--quiet`.
fn progress(quiet: bool, template: &str) -> indicatif::ProgressBar {
    if quiet {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::no_length();
    bar.set_style(
        indicatif::ProgressStyle::with_template(template)
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_spinner()),
    );
    bar
}

pub async fn run(args: ExportArgs) -> anyhow::Result<()> {
    let body = filter_body(&args.filters)?;
    let endpoint = format!("{}/v1/audit/exports", args.url.trim_end_matches('/'));
    let client = reqwest::Client::builder()
        .connect_timeout(Duration::from_secs(10))
        .build()
        .context("cannot build the HTTP client")?;

    let waiting = progress(
        args.quiet,
        "{spinner} exporting: the service is collecting events and proofs ({elapsed})",
    );
    waiting.enable_steady_tick(Duration::from_millis(120));
    let response = client
        .post(&endpoint)
        .bearer_auth(&args.token)
        .json(&body)
        .send()
        .await
        .with_context(|| format!("cannot reach {endpoint}"));
    waiting.finish_and_clear();
    let mut response = response?;
    if !response.status().is_success() {
        let status = response.status();
        let problem: Value = response.json().await.unwrap_or_default();
        bail!(
            "the service refused the export ({status}): {}",
            problem["detail"]
                .as_str()
                .or(problem["title"].as_str())
                .unwrap_or("no detail given")
        );
    }

    let bar = match response.content_length() {
        Some(total) => {
            let bar = progress(
                args.quiet,
                "downloading {bar:40} {bytes}/{total_bytes} ({bytes_per_sec}, eta {eta})",
            );
            bar.set_length(total);
            bar
        }
        None => progress(
            args.quiet,
            "{spinner} downloading {bytes} ({bytes_per_sec})",
        ),
    };
    let partial = partial_path(&args.output);
    let mut file = std::fs::File::create(&partial)
        .with_context(|| format!("cannot create {}", partial.display()))?;
    let mut written = 0u64;
    while let Some(chunk) = response
        .chunk()
        .await
        .context("the download was interrupted")?
    {
        file.write_all(&chunk)
            .with_context(|| format!("cannot write {}", partial.display()))?;
        written += chunk.len() as u64;
        bar.set_position(written);
    }
    file.sync_all()
        .with_context(|| format!("cannot write {}", partial.display()))?;
    drop(file);
    bar.finish_and_clear();
    // Renamed only once whole, so a file at `output` is never a truncated bundle.
    std::fs::rename(&partial, &args.output)
        .with_context(|| format!("cannot write {}", args.output.display()))?;
    if !args.quiet {
        println!(
            "wrote the evidence bundle to {} ({written} bytes); check it offline with `aether audit verify {} --public-key <the operator's checkpoint key>`",
            args.output.display(),
            args.output.display()
        );
    }
    Ok(())
}

fn partial_path(output: &Path) -> PathBuf {
    let mut name = output.file_name().unwrap_or_default().to_os_string();
    name.push(".part");
    output.with_file_name(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filters_are_key_value_pairs() {
        let body = filter_body(&["member=m-3".into(), "to=2026-12-01T00:00:00Z".into()]).unwrap();
        assert_eq!(body["member"], "m-3");
        assert_eq!(body["to"], "2026-12-01T00:00:00Z");
        assert!(filter_body(&["member".into()]).is_err());
        assert!(filter_body(&["=x".into()]).is_err());
        assert_eq!(
            partial_path(Path::new("/tmp/b.json")),
            Path::new("/tmp/b.json.part")
        );
    }
}
