use std::collections::HashMap;

/// Parses `key = value` lines with sections, like a tiny INI reader.
fn parse_config(text: &str) -> Result<HashMap<String, String>, String> {
    let mut entries = HashMap::new();
    let mut section = String::new();
    for (number, raw) in text.lines().enumerate() {
        let line = strip_comment(raw).trim();
        if line.is_empty() {
            continue;
        }
        if line.starts_with('[') && line.ends_with(']') {
            section = line[1..line.len() - 1].trim().to_string();
            continue;
        }
        let Some((key, value)) = line.split_once('=') else {
            return Err(format!("line {}: expected key = value", number + 1));
        };
        let full = if section.is_empty() {
            key.trim().to_string()
        } else {
            format!("{}.{}", section, key.trim())
        };
        entries.insert(full, value.trim().to_string());
    }
    Ok(entries)
}

fn strip_comment(line: &str) -> &str {
    match line.find(['#', ';']) {
        Some(at) => &line[..at],
        None => line,
    }
}

fn get_number(entries: &HashMap<String, String>, key: &str, fallback: i64) -> i64 {
    entries.get(key).and_then(|v| v.parse().ok()).unwrap_or(fallback)
}

fn main() {
    let text = "name = demo\n[server]\nport = 8080 # default\nworkers = 4\n";
    let entries = parse_config(text).expect("valid config");
    let port = get_number(&entries, "server.port", 80);
    let workers = get_number(&entries, "server.workers", 1) * 2;
    println!("{} entries, port {}, workers {}", entries.len(), port, workers);
}
