//! SQuAD v1.1 / v2.0 JSON (`{"data": [{"title", "paragraphs": [{"context",
//! "qas": [...]}]}]}`); unanswerable v2.0 questions are dropped.
//!
//! The data path comes from the caller (config or CLI) or from the
//! environment variable `TOLERABLE_SQUAD_DIR` (a folder holding
//! `squad-dev.json` and `squad-train.json`); passages are never copied into
//! the repository.

use crate::error::{ProbeError, Result};
use crate::item::QaItem;
use serde::Deserialize;
use std::path::{Path, PathBuf};

/// The environment variable naming the SQuAD folder.
pub const SQUAD_DIR_ENV: &str = "TOLERABLE_SQUAD_DIR";

/// Which SQuAD split.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Split {
    /// The dev split: evaluation items.
    Dev,
    /// The train split: bridge-training items.
    Train,
}

impl Split {
    fn file_name(self) -> &'static str {
        match self {
            Split::Dev => "squad-dev.json",
            Split::Train => "squad-train.json",
        }
    }
}

/// The file of `split`: `explicit` if given (a file, or a folder holding
/// `squad-dev.json` / `squad-train.json`), else `$TOLERABLE_SQUAD_DIR`.
pub fn resolve_path(explicit: Option<&Path>, split: Split) -> Result<PathBuf> {
    let base = match explicit {
        Some(p) => p.to_path_buf(),
        None => std::env::var_os(SQUAD_DIR_ENV).map(PathBuf::from).ok_or_else(|| {
            ProbeError::Config(format!(
                "no SQuAD path: give one in the config or on the command line, or set {SQUAD_DIR_ENV}"
            ))
        })?,
    };
    let file = if base.is_dir() { base.join(split.file_name()) } else { base };
    if !file.exists() {
        return Err(ProbeError::Dataset {
            path: file,
            reason: "does not exist".into(),
        });
    }
    Ok(file)
}

#[derive(Deserialize)]
struct File {
    data: Vec<Article>,
}

#[derive(Deserialize)]
struct Article {
    #[serde(default)]
    title: String,
    paragraphs: Vec<Paragraph>,
}

#[derive(Deserialize)]
struct Paragraph {
    context: String,
    qas: Vec<Qa>,
}

#[derive(Deserialize)]
struct Qa {
    id: String,
    question: String,
    #[serde(default)]
    answers: Vec<Answer>,
    #[serde(default)]
    is_impossible: bool,
}

#[derive(Deserialize)]
struct Answer {
    text: String,
}

/// Parses SQuAD JSON text; `path` names the source in errors.
pub fn parse(text: &str, path: &Path) -> Result<Vec<QaItem>> {
    let f: File = serde_json::from_str(text).map_err(|e| ProbeError::Dataset {
        path: path.to_path_buf(),
        reason: format!("not SQuAD JSON: {e}"),
    })?;
    let mut items = Vec::new();
    for a in f.data {
        for p in a.paragraphs {
            for q in p.qas {
                if q.is_impossible || q.answers.is_empty() {
                    continue;
                }
                let mut answers: Vec<String> = Vec::new();
                for ans in q.answers {
                    let t = ans.text.trim().to_string();
                    if !t.is_empty() && !answers.contains(&t) {
                        answers.push(t);
                    }
                }
                if answers.is_empty() {
                    continue;
                }
                items.push(QaItem {
                    id: q.id,
                    title: a.title.clone(),
                    context: p.context.clone(),
                    question: q.question,
                    answers,
                });
            }
        }
    }
    if items.is_empty() {
        return Err(ProbeError::EmptyDataset(path.to_path_buf()));
    }
    Ok(items)
}

/// Loads every answerable question of a SQuAD JSON file.
pub fn load(path: &Path) -> Result<Vec<QaItem>> {
    let text = std::fs::read_to_string(path).map_err(|e| ProbeError::Dataset {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })?;
    parse(&text, path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn v2_unanswerable_are_dropped() {
        let text = r#"{"version":"v2.0","data":[{"title":"T","paragraphs":[{"context":"Paris is in France.","qas":[
            {"id":"a","question":"Where is Paris?","answers":[{"text":"France","answer_start":12},{"text":"France","answer_start":12}],"is_impossible":false},
            {"id":"b","question":"Where is Rome?","answers":[],"is_impossible":true}]}]}]}"#;
        let items = parse(text, Path::new("x.json")).unwrap();
        assert_eq!(items.len(), 1);
        assert_eq!(items[0].answers, vec!["France".to_string()]);
        assert_eq!(items[0].title, "T");
    }

    #[test]
    fn malformed_and_empty_files_are_named() {
        let e = parse("{not json", Path::new("bad.json")).unwrap_err().to_string();
        assert!(e.contains("bad.json") && e.contains("not SQuAD JSON"), "{e}");
        let e = parse(r#"{"data":[]}"#, Path::new("empty.json")).unwrap_err().to_string();
        assert!(e.contains("empty.json") && e.contains("no answerable"), "{e}");
        let e = load(Path::new("/nonexistent/squad.json")).unwrap_err().to_string();
        assert!(e.contains("/nonexistent/squad.json"), "{e}");
    }

    #[test]
    fn reads_the_shared_dev_subset() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/data/squad");
        let p = resolve_path(Some(&dir), Split::Dev).unwrap();
        let items = load(&p).unwrap();
        assert!(items.len() > 8000, "{}", items.len());
        let sb = items.iter().find(|i| i.context.starts_with("Super Bowl 50 was")).unwrap();
        assert!(sb.answers.iter().any(|a| a.contains("Denver Broncos")) || !sb.answers.is_empty());
    }
}
