struct Summary {
    count: usize,
    mean: f64,
    variance: f64,
    min: f64,
    max: f64,
}

fn summarize(samples: &[f64]) -> Option<Summary> {
    if samples.is_empty() {
        return None;
    }
    let mut mean = 0.0;
    let mut m2 = 0.0;
    let mut lo = f64::INFINITY;
    let mut hi = f64::NEG_INFINITY;
    for (i, &x) in samples.iter().enumerate() {
        let delta = x - mean;
        mean += delta / (i as f64 + 1.0);
        m2 += delta * (x - mean);
        lo = lo.min(x);
        hi = hi.max(x);
    }
    let count = samples.len();
    let variance = if count > 1 { m2 / (count as f64 - 1.0) } else { 0.0 };
    Some(Summary { count, mean, variance, min: lo, max: hi })
}

fn percentile(sorted: &[f64], q: f64) -> f64 {
    let rank = q * (sorted.len() - 1) as f64;
    let below = rank.floor() as usize;
    let above = rank.ceil() as usize;
    let weight = rank - below as f64;
    sorted[below] * (1.0 - weight) + sorted[above] * weight
}

fn main() {
    let mut samples = vec![12.5, 9.0, 14.25, 11.0, 30.0, 10.5];
    samples.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let median = percentile(&samples, 0.5);
    if let Some(s) = summarize(&samples) {
        let spread = s.max - s.min;
        println!("n={} mean={:.2} sd={:.2}", s.count, s.mean, s.variance.sqrt());
        println!("median={median} spread={spread}");
    }
}
