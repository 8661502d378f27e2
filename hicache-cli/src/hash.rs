//! `hicache hash`: page hashes of token ids read from standard input.

use std::io::{BufRead, Write};

use clap::{Args, ValueEnum};
use hicache_core::{DType, HashMode, KvKind, LayoutKind, Namespace, PageHash, PageHasher};

use crate::error::{CliError, Result};

/// Hash mode on the command line.
#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum ModeArg {
    /// Bit-exact with SGLang's storage keys.
    Sglang,
    /// Seeded by a namespace (see `--model`, `--extra-key`, `--cache-salt`).
    Namespaced,
}

/// Arguments of `hash`.
#[derive(Debug, Args)]
pub struct HashArgs {
    /// Hash mode.
    #[arg(long, value_enum, default_value = "sglang")]
    pub mode: ModeArg,
    /// Tokens per page.
    #[arg(long, default_value_t = 64)]
    pub page_size: u32,
    /// Hex digest of the page before the first one (overrides the namespace seed).
    #[arg(long)]
    pub prior: Option<String>,
    /// Model fingerprint of the namespace (namespaced mode).
    #[arg(long, default_value = "default")]
    pub model: String,
    /// Extra key (e.g. LoRA id) of the tenant (namespaced mode).
    #[arg(long)]
    pub extra_key: Option<String>,
    /// Cache salt of the tenant (namespaced mode).
    #[arg(long)]
    pub cache_salt: Option<String>,
}

/// Parses whitespace-separated u32 token ids, naming the first bad one.
pub fn parse_tokens(text: &str) -> Result<Vec<u32>> {
    text.split_ascii_whitespace()
        .enumerate()
        .map(|(i, w)| {
            w.parse::<u32>().map_err(|e| {
                CliError::Usage(format!("token {i} ({w:?}) is not an id in 0..2^32: {e}"))
            })
        })
        .collect()
}

/// Runs `hash` over `input`, writing one hex digest per whole page to `out`.
pub fn run(args: &HashArgs, input: impl BufRead, mut out: impl Write) -> Result<()> {
    let mut text = String::new();
    for line in input.lines() {
        let line = line.map_err(CliError::io("<stdin>"))?;
        text.push_str(&line);
        text.push(' ');
    }
    let tokens = parse_tokens(&text)?;
    let hasher = match args.mode {
        ModeArg::Sglang => PageHasher::sglang(args.page_size)?,
        ModeArg::Namespaced => {
            let ns = Namespace::single_rank(
                args.model.clone(),
                DType::Bf16,
                LayoutKind::PageFirst,
                KvKind::Mha {
                    heads: 8,
                    head_dim: 128,
                },
                32,
                args.page_size,
            );
            PageHasher::new(HashMode::Namespaced, &ns)?
        }
    };
    let prior = match &args.prior {
        Some(p) => Some(PageHash::from_hex(p)?),
        None => {
            hasher
                .chain_start(args.extra_key.as_deref(), args.cache_salt.as_deref())
                .prior
        }
    };
    let tail = tokens.len() % args.page_size as usize;
    for h in hasher.hash_pages(prior, &tokens) {
        writeln!(out, "{h}").map_err(CliError::io("<stdout>"))?;
    }
    if tail != 0 {
        eprintln!(
            "note: the last {tail} tokens do not fill a page of {} and were not hashed",
            args.page_size
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(mode: ModeArg, page_size: u32) -> HashArgs {
        HashArgs {
            mode,
            page_size,
            prior: None,
            model: "default".into(),
            extra_key: None,
            cache_salt: None,
        }
    }

    #[test]
    fn prints_sglang_hashes_per_page() {
        let mut out = Vec::new();
        run(&args(ModeArg::Sglang, 4), "1 2\n3 4 5".as_bytes(), &mut out).unwrap();
        let s = String::from_utf8(out).unwrap();
        assert_eq!(
            s.trim(),
            "cf97adeedb59e05bfd73a2b4c2a8885708c4f4f70c84c64b27120e72ab733b72"
        );
    }

    #[test]
    fn bad_tokens_are_usage_errors() {
        let err = run(&args(ModeArg::Sglang, 4), "1 x".as_bytes(), Vec::new()).unwrap_err();
        assert_eq!(err.exit_code(), 2);
        assert!(err.to_string().contains("token 1"));
        let err = run(
            &args(ModeArg::Sglang, 4),
            "4294967296".as_bytes(),
            Vec::new(),
        )
        .unwrap_err();
        assert_eq!(err.exit_code(), 2);
        assert!(run(&args(ModeArg::Namespaced, 0), "1".as_bytes(), Vec::new()).is_err());
    }
}
