//! SQuAD v1.1 / v2.0 JSON (`{"data": [{"title", "paragraphs": [{"context",
//! "qas": [...]}]}]}`; unanswerable v2.0 questions are dropped) and the
//! Hugging Face parquet layout of `rajpurkar/squad` (columns id, title,
//! context, question, answers{text, answer_start}).
//!
//! The data path comes from the caller (config or CLI) or from the
//! environment variable `TOLERABLE_SQUAD_DIR` (a folder holding
//! `squad-dev.json` and `squad-train.json`); `hf` instead of a path takes
//! `rajpurkar/squad` through hf-hub (its cache, or the hub where reachable).
//! Passages are never copied into the repository.

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

/// The Hugging Face dataset repository of SQuAD v1.1.
pub const HF_REPO: &str = "rajpurkar/squad";

/// The parquet file of `split` in [`HF_REPO`].
pub fn hf_file(split: Split) -> &'static str {
    match split {
        Split::Dev => "plain_text/validation-00000-of-00001.parquet",
        Split::Train => "plain_text/train-00000-of-00001.parquet",
    }
}

/// The file of `split`: `explicit` if given (a file, a folder holding
/// `squad-dev.json` / `squad-train.json`, or `hf` for the hub's parquet
/// through the hub cache), else `$TOLERABLE_SQUAD_DIR`.
pub fn resolve_path(explicit: Option<&Path>, split: Split) -> Result<PathBuf> {
    if explicit.is_some_and(|p| p == Path::new("hf")) {
        let cache = tolerable_fetch::hub::hub_cache_dir();
        return Ok(tolerable_fetch::hub::dataset_file(
            HF_REPO,
            hf_file(split),
            &cache,
        )?);
    }
    let base = match explicit {
        Some(p) => p.to_path_buf(),
        None => std::env::var_os(SQUAD_DIR_ENV).map(PathBuf::from).ok_or_else(|| {
            ProbeError::Config(format!(
                "no SQuAD path: give one in the config or on the command line, or set {SQUAD_DIR_ENV}"
            ))
        })?,
    };
    let file = if base.is_dir() {
        base.join(split.file_name())
    } else {
        base
    };
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

/// Loads every answerable question of a SQuAD file: parquet (Hugging Face
/// layout) by its extension, JSON otherwise.
pub fn load(path: &Path) -> Result<Vec<QaItem>> {
    if path.extension().is_some_and(|e| e == "parquet") {
        return load_parquet(path);
    }
    let text = std::fs::read_to_string(path).map_err(|e| ProbeError::Dataset {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })?;
    parse(&text, path)
}

/// Loads the Hugging Face parquet layout of SQuAD (id, title, context,
/// question, answers{text: [..], answer_start: [..]}).
pub fn load_parquet(path: &Path) -> Result<Vec<QaItem>> {
    use parquet::file::reader::{FileReader, SerializedFileReader};
    use parquet::record::Field;
    let bad = |reason: String| ProbeError::Dataset {
        path: path.to_path_buf(),
        reason,
    };
    let file = std::fs::File::open(path).map_err(|e| bad(e.to_string()))?;
    let reader =
        SerializedFileReader::new(file).map_err(|e| bad(format!("not a parquet file: {e}")))?;
    let rows = reader.get_row_iter(None).map_err(|e| bad(e.to_string()))?;
    let mut items = Vec::new();
    for row in rows {
        let row = row.map_err(|e| bad(e.to_string()))?;
        let (mut id, mut title, mut context, mut question) = (None, String::new(), None, None);
        let mut answers: Vec<String> = Vec::new();
        for (name, field) in row.get_column_iter() {
            match (name.as_str(), field) {
                ("id", Field::Str(s)) => id = Some(s.clone()),
                ("title", Field::Str(s)) => title = s.clone(),
                ("context", Field::Str(s)) => context = Some(s.clone()),
                ("question", Field::Str(s)) => question = Some(s.clone()),
                ("answers", Field::Group(g)) => {
                    for (sub, f) in g.get_column_iter() {
                        if let ("text", Field::ListInternal(list)) = (sub.as_str(), f) {
                            for e in list.elements() {
                                if let Field::Str(t) = e {
                                    let t = t.trim().to_string();
                                    if !t.is_empty() && !answers.contains(&t) {
                                        answers.push(t);
                                    }
                                }
                            }
                        }
                    }
                }
                _ => {}
            }
        }
        let (Some(id), Some(context), Some(question)) = (id, context, question) else {
            return Err(bad(
                "a row lacks id, context or question (not the rajpurkar/squad layout)".into(),
            ));
        };
        if answers.is_empty() {
            continue;
        }
        items.push(QaItem {
            id,
            title,
            context,
            question,
            answers,
        });
    }
    if items.is_empty() {
        return Err(ProbeError::EmptyDataset(path.to_path_buf()));
    }
    Ok(items)
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
        let e = parse("{not json", Path::new("bad.json"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("bad.json") && e.contains("not SQuAD JSON"),
            "{e}"
        );
        let e = parse(r#"{"data":[]}"#, Path::new("empty.json"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("empty.json") && e.contains("no answerable"),
            "{e}"
        );
        let e = load(Path::new("/nonexistent/squad.json"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("/nonexistent/squad.json"), "{e}");
    }

    #[test]
    fn reads_the_hugging_face_parquet_layout() {
        let p =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/squad-hf-layout.parquet");
        let items = load(&p).unwrap();
        assert_eq!(items.len(), 3);
        assert_eq!(
            items[1].answers,
            vec!["the Osk river".to_string(), "Osk".to_string()]
        );
        assert_eq!(items[2].title, "Quorin");
        let e = load_parquet(
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("Cargo.toml")
                .as_path(),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("not a parquet file"), "{e}");
    }

    #[test]
    fn hub_layout_resolves_from_a_local_cache() {
        let dir = tempfile::tempdir().unwrap();
        let commit = "89abcdef0123456789abcdef0123456789abcdef";
        let repo_dir = dir.path().join("datasets--rajpurkar--squad");
        let file = repo_dir
            .join("snapshots")
            .join(commit)
            .join(hf_file(Split::Dev));
        std::fs::create_dir_all(file.parent().unwrap()).unwrap();
        std::fs::copy(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/squad-hf-layout.parquet"),
            &file,
        )
        .unwrap();
        std::fs::create_dir_all(repo_dir.join("refs")).unwrap();
        std::fs::write(repo_dir.join("refs/main"), commit).unwrap();
        let p =
            tolerable_fetch::hub::dataset_file(HF_REPO, hf_file(Split::Dev), dir.path()).unwrap();
        assert_eq!(p, file);
        assert_eq!(load(&p).unwrap().len(), 3);
    }

    #[test]
    fn reads_the_shared_dev_subset() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/data/squad");
        let p = resolve_path(Some(&dir), Split::Dev).unwrap();
        let items = load(&p).unwrap();
        assert!(items.len() > 8000, "{}", items.len());
        let sb = items
            .iter()
            .find(|i| i.context.starts_with("Super Bowl 50 was"))
            .unwrap();
        assert!(sb.answers.iter().any(|a| a.contains("Denver Broncos")) || !sb.answers.is_empty());
    }
}
