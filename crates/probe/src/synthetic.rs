//! The synthetic fact probe: short passages about invented people, places,
//! organisations and dates, each with a question whose answer is a span.
//! Generated from a seed; the embedded default for a first run and for tests.

use crate::item::QaItem;
use crate::rng::Rng;

const ONSETS: &[&str] = &[
    "b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "kl", "tr",
    "st", "gr",
];
const VOWELS: &[&str] = &["a", "e", "i", "o", "u", "ae", "io", "ou"];
const CODAS: &[&str] = &["", "n", "r", "l", "s", "th", "m", "x", "nd", "rk"];
const PLACE_SUFFIX: &[&str] = &[
    "ford", "holm", "vale", "burg", "mouth", "wick", "stead", "haven",
];
const ORG_KIND: &[&str] = &[
    "Society",
    "Institute",
    "Company",
    "Guild",
    "Observatory",
    "Academy",
];
const FIELDS: &[&str] = &[
    "glass", "maps", "clocks", "bridges", "textiles", "lenses", "ships", "music",
];
const MONTHS: &[&str] = &[
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];

fn word(rng: &mut Rng, syllables: usize) -> String {
    let mut w = String::new();
    for _ in 0..syllables {
        w.push_str(rng.pick::<&str>(ONSETS));
        w.push_str(rng.pick::<&str>(VOWELS));
    }
    w.push_str(rng.pick::<&str>(CODAS));
    let mut c = w.chars();
    match c.next() {
        Some(f) => f.to_uppercase().collect::<String>() + c.as_str(),
        None => w,
    }
}

/// One invented biography and the facts in it.
struct Facts {
    person: String,
    birthplace: String,
    year: u32,
    month: String,
    org: String,
    field: String,
    city: String,
    successor: String,
}

fn facts(rng: &mut Rng) -> Facts {
    let syl = 2 + rng.below(2);
    let s2 = 1 + rng.below(2);
    Facts {
        person: format!("{} {}", word(rng, syl), word(rng, s2)),
        birthplace: format!("{}{}", word(rng, 1), *rng.pick(PLACE_SUFFIX)),
        year: 1700 + rng.below(250) as u32,
        month: rng.pick(MONTHS).to_string(),
        org: format!("{} {}", word(rng, 2), *rng.pick(ORG_KIND)),
        field: rng.pick(FIELDS).to_string(),
        city: format!("{}{}", word(rng, 2), *rng.pick(PLACE_SUFFIX)),
        successor: format!("{} {}", word(rng, 2), word(rng, 2)),
    }
}

/// `n` synthetic items from `seed`; ids are `syn-{seed}-{k}`.
pub fn generate(n: usize, seed: u64) -> Vec<QaItem> {
    let mut rng = Rng::new(seed ^ 0x5EED_FAC7);
    let mut out = Vec::with_capacity(n);
    let mut k = 0;
    while out.len() < n {
        let f = facts(&mut rng);
        let passage = format!(
            "{p} was born in {b} in {m} {y}. After years of work on {fld}, {p} founded the {o} in the city of {c}. \
             The {o} became known for its {fld}, and when {p} retired, leadership passed to {s}.",
            p = f.person, b = f.birthplace, m = f.month, y = f.year, fld = f.field, o = f.org, c = f.city, s = f.successor
        );
        let qa: [(String, String); 5] = [
            (
                format!("Where was {} born?", f.person),
                f.birthplace.clone(),
            ),
            (
                format!("In what year was {} born?", f.person),
                f.year.to_string(),
            ),
            (
                format!("What organisation did {} found?", f.person),
                format!("the {}", f.org),
            ),
            (
                format!(
                    "In which city was the organisation founded by {} located?",
                    f.person
                ),
                f.city.clone(),
            ),
            (
                format!("Who took over leadership after {} retired?", f.person),
                f.successor.clone(),
            ),
        ];
        let (q, a) = qa[rng.below(qa.len())].clone();
        // Invented words can collide; keep only items whose answer is absent from the question.
        if !q.to_lowercase().contains(&a.to_lowercase()) {
            out.push(QaItem {
                id: format!("syn-{seed}-{k}"),
                title: format!("synthetic:{}", f.person),
                context: passage,
                question: q,
                answers: vec![a],
            });
        }
        k += 1;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seeded_and_answerable() {
        let a = generate(50, 3);
        assert_eq!(a, generate(50, 3));
        assert_ne!(a, generate(50, 4));
        for it in &a {
            let ans = &it.answers[0];
            let bare = ans.strip_prefix("the ").unwrap_or(ans);
            assert!(it.context.contains(bare), "{it:?}");
            assert!(!it.question.contains(ans.as_str()));
        }
    }
}
