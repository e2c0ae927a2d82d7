//! The documented schema of the records is the declared one: each record
//! type's generated column table (name, type, meaning) appears verbatim in
//! `results/README.md`. Changing a column without the README fails here;
//! `TOLERABLE_PRINT_SCHEMA=1` prints the tables to paste.

use tolerable_driver::records::columns::schema_markdown;
use tolerable_driver::records::{
    ItemRow, MeasureRow, PairRow, ResourceRow, SampleRow, SeedRow, SummaryRow,
};

#[test]
fn results_readme_documents_the_declared_columns() {
    let readme = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../results/README.md");
    let text = std::fs::read_to_string(&readme).unwrap();
    let tables = [
        (
            "items/cell-*.parquet (ItemRow)",
            schema_markdown::<ItemRow>(),
        ),
        (
            "summary.parquet (SummaryRow)",
            schema_markdown::<SummaryRow>(),
        ),
        ("sample.parquet (SampleRow)", schema_markdown::<SampleRow>()),
        (
            "pairs.parquet, pairs-interim.parquet (PairRow)",
            schema_markdown::<PairRow>(),
        ),
        (
            "seeds.parquet, seeds-interim.parquet (SeedRow)",
            schema_markdown::<SeedRow>(),
        ),
        (
            "resources.parquet (ResourceRow)",
            schema_markdown::<ResourceRow>(),
        ),
        (
            "measurement runs' units/*.parquet, oracle/*.parquet, summary.parquet (MeasureRow)",
            schema_markdown::<MeasureRow>(),
        ),
    ];
    if std::env::var("TOLERABLE_PRINT_SCHEMA").is_ok_and(|v| v == "1") {
        for (what, t) in &tables {
            println!("{what}\n\n{t}");
        }
    }
    for (what, t) in &tables {
        assert!(
            text.contains(t.as_str()),
            "results/README.md does not hold the schema of {what}; it should contain:\n\n{t}"
        );
    }
}
