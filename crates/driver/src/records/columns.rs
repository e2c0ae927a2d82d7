//! Columns declared once: a record struct written with [`record!`] is its
//! own column table. The same declaration writes rows to a table, reads a
//! table back into rows, and lists the schema (name, Arrow type, meaning)
//! that `results/README.md` documents — a snapshot test holds the two equal.

use crate::error::{DriverError, Result};
use polars::prelude::*;

/// A type that is one or more columns of a record table.
pub trait Columns: Sized {
    /// Name, Arrow type and meaning of each column, for a field `name`
    /// documented as `doc` (a nested record ignores both and lists its own).
    fn schema(name: &'static str, doc: &'static str) -> Vec<(&'static str, &'static str, String)>;
    /// The columns of `values` (one per row).
    fn columns(name: &'static str, values: Vec<Self>) -> Vec<Column>;
    /// The values of a table's rows.
    fn read(df: &DataFrame, name: &'static str) -> Result<Vec<Self>>;
}

fn col<'a>(df: &'a DataFrame, name: &str) -> Result<&'a Column> {
    df.column(name)
        .map_err(|_| DriverError::Records(format!("no column `{name}` in the table")))
}

fn typed<T>(name: &str, r: PolarsResult<T>) -> Result<T> {
    r.map_err(|e| DriverError::Records(format!("column `{name}`: {e}")))
}

/// A value of a column that may not hold nulls.
fn required<T>(x: Option<T>, name: &str) -> PolarsResult<T> {
    x.ok_or_else(|| polars_err!(ComputeError: "a null in column `{}`, which holds no nulls", name))
}

macro_rules! leaf {
    // `absent`: the value of every row when an older table lacks the column
    // (nullable columns, added later, read as nulls); without it a missing
    // column is an error naming it.
    ($ty:ty, $arrow:literal, |$n:ident, $v:ident| $make:expr, |$c:ident| $read:expr $(, absent = $absent:expr)?) => {
        impl Columns for $ty {
            fn schema(
                name: &'static str,
                doc: &'static str,
            ) -> Vec<(&'static str, &'static str, String)> {
                vec![(name, $arrow, doc.trim().to_string())]
            }
            fn columns($n: &'static str, $v: Vec<Self>) -> Vec<Column> {
                vec![$make]
            }
            fn read(df: &DataFrame, name: &'static str) -> Result<Vec<Self>> {
                $(
                    if df.column(name).is_err() {
                        return Ok(vec![$absent; df.height()]);
                    }
                )?
                let $c = col(df, name)?;
                typed(name, (|| -> PolarsResult<Vec<Self>> { Ok($read) })())
            }
        }
    };
}

leaf!(String, "string", |n, v| Column::new(n.into(), v), |c| c
    .str()?
    .iter()
    .map(|x| required(x, c.name()).map(String::from))
    .collect::<PolarsResult<_>>()?);
leaf!(
    Option<String>,
    "string (nullable)",
    |n, v| Column::new(n.into(), v),
    |c| c.str()?.iter().map(|x| x.map(String::from)).collect(),
    absent = None
);
leaf!(i64, "int64", |n, v| Column::new(n.into(), v), |c| c
    .i64()?
    .iter()
    .map(|x| required(x, c.name()))
    .collect::<PolarsResult<_>>()?);
leaf!(
    Option<i64>,
    "int64 (nullable)",
    |n, v| Column::new(n.into(), v),
    |c| c.i64()?.iter().collect(),
    absent = None
);
leaf!(f64, "double", |n, v| Column::new(n.into(), v), |c| c
    .f64()?
    .iter()
    .map(|x| required(x, c.name()))
    .collect::<PolarsResult<_>>()?);
leaf!(
    Option<f64>,
    "double (nullable)",
    |n, v| Column::new(n.into(), v),
    |c| c.f64()?.iter().collect(),
    absent = None
);
leaf!(bool, "bool", |n, v| Column::new(n.into(), v), |c| c
    .bool()?
    .iter()
    .map(|x| required(x, c.name()))
    .collect::<PolarsResult<_>>()?);
leaf!(
    Option<bool>,
    "bool (nullable)",
    |n, v| Column::new(n.into(), v),
    |c| c.bool()?.iter().collect(),
    absent = None
);
/// A list column of one element type: `$get` reads the element series'
/// values (a polars accessor), `$own` makes each an owned value.
macro_rules! list_leaf {
    ($ty:ty, $arrow:literal, $get:ident, |$x:ident| $own:expr) => {
        leaf!(
            Vec<$ty>,
            $arrow,
            |n, v| {
                let s: Vec<Series> = v.iter().map(|x| Series::new("".into(), x)).collect();
                Column::new(n.into(), s)
            },
            |c| {
                let lc = c.list()?;
                let mut out = Vec::with_capacity(lc.len());
                for i in 0..lc.len() {
                    out.push(match lc.get_as_series(i) {
                        Some(s) => s
                            .$get()?
                            .iter()
                            .map(|$x| required($x, c.name()).map(|$x| $own))
                            .collect::<PolarsResult<_>>()?,
                        None => required(None, c.name())?,
                    });
                }
                out
            }
        );
    };
}
list_leaf!(u32, "list<uint32>", u32, |x| x);
list_leaf!(i64, "list<int64>", i64, |x| x);
list_leaf!(f64, "list<double>", f64, |x| x);
list_leaf!(String, "list<string>", str, |x| String::from(x));

/// Values measured per injection site: the site's hook name
/// (`blocks.3.attn.hook_rot_k`, `blocks.3.attn.hook_v`,
/// `blocks.3.hook_resid_pre`) and the value there. A field `x` of this type
/// is two list columns, `x_sites` and `x_values`, read as empty lists from a
/// table written before they existed (both absent; one alone is an error).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PerSite(pub Vec<(String, f64)>);

impl Columns for PerSite {
    fn schema(name: &'static str, doc: &'static str) -> Vec<(&'static str, &'static str, String)> {
        let leak = |s: String| -> &'static str { Box::leak(s.into_boxed_str()) };
        vec![
            (
                leak(format!("{name}_sites")),
                "list<string>",
                format!("{} The sites, as hook names.", doc.trim()),
            ),
            (
                leak(format!("{name}_values")),
                "list<double>",
                "The values at those sites, in the same order.".to_string(),
            ),
        ]
    }

    fn columns(name: &'static str, values: Vec<Self>) -> Vec<Column> {
        let sites: Vec<Series> = values
            .iter()
            .map(|v| {
                Series::new(
                    "".into(),
                    v.0.iter().map(|(s, _)| s.as_str()).collect::<Vec<_>>(),
                )
            })
            .collect();
        let vals: Vec<Series> = values
            .iter()
            .map(|v| Series::new("".into(), v.0.iter().map(|(_, x)| *x).collect::<Vec<f64>>()))
            .collect();
        vec![
            Column::new(format!("{name}_sites").into(), sites),
            Column::new(format!("{name}_values").into(), vals),
        ]
    }

    fn read(df: &DataFrame, name: &'static str) -> Result<Vec<Self>> {
        let (sn, vn) = (format!("{name}_sites"), format!("{name}_values"));
        let (sc, vc) = match (df.column(&sn), df.column(&vn)) {
            (Ok(sc), Ok(vc)) => (sc, vc),
            (Err(_), Err(_)) => return Ok(vec![PerSite::default(); df.height()]),
            _ => {
                return Err(DriverError::Records(format!(
                    "`{sn}` and `{vn}` go together; the table holds only one"
                )))
            }
        };
        typed(
            &sn,
            (|| -> PolarsResult<Vec<Self>> {
                let (sl, vl) = (sc.list()?, vc.list()?);
                let mut out = Vec::with_capacity(sl.len());
                for i in 0..sl.len() {
                    let names: Vec<String> = match sl.get_as_series(i) {
                        Some(s) => s
                            .str()?
                            .iter()
                            .map(|v| required(v, &sn).map(String::from))
                            .collect::<PolarsResult<_>>()?,
                        None => Vec::new(),
                    };
                    let xs: Vec<f64> = match vl.get_as_series(i) {
                        Some(s) => s
                            .f64()?
                            .iter()
                            .map(|v| required(v, &vn))
                            .collect::<PolarsResult<_>>()?,
                        None => Vec::new(),
                    };
                    if names.len() != xs.len() {
                        polars_bail!(ComputeError: "row {i}: {} sites and {} values", names.len(), xs.len());
                    }
                    out.push(PerSite(names.into_iter().zip(xs).collect()));
                }
                Ok(out)
            })(),
        )
    }
}

/// Declares a record: the struct, and its [`Columns`] implementation in
/// field order. Every field has a doc comment, which is the column's
/// documented meaning; a field whose type is itself a record contributes
/// its own columns (flattened).
#[macro_export]
macro_rules! record {
    (
        $(#[$meta:meta])*
        pub struct $name:ident {
            $( #[doc = $doc:literal] pub $field:ident : $ty:ty ),* $(,)?
        }
    ) => {
        $(#[$meta])*
        pub struct $name {
            $( #[doc = $doc] pub $field: $ty ),*
        }

        impl $crate::records::columns::Columns for $name {
            fn schema(_: &'static str, _: &'static str) -> Vec<(&'static str, &'static str, String)> {
                let mut out = Vec::new();
                $( out.extend(<$ty as $crate::records::columns::Columns>::schema(stringify!($field), $doc)); )*
                out
            }
            fn columns(_: &'static str, values: Vec<Self>) -> Vec<polars::prelude::Column> {
                let mut out = Vec::new();
                $(
                    let v: Vec<$ty> = values.iter().map(|r| r.$field.clone()).collect();
                    out.extend(<$ty as $crate::records::columns::Columns>::columns(stringify!($field), v));
                )*
                out
            }
            fn read(df: &polars::prelude::DataFrame, _: &'static str) -> $crate::error::Result<Vec<Self>> {
                $( let mut $field = <$ty as $crate::records::columns::Columns>::read(df, stringify!($field))?.into_iter(); )*
                let mut out = Vec::with_capacity(df.height());
                for _ in 0..df.height() {
                    out.push(Self { $( $field: $field.next().ok_or_else(|| $crate::error::DriverError::Records(format!("column `{}` is short", stringify!($field))))? ),* });
                }
                Ok(out)
            }
        }
    };
}

/// Rows of a record type as a table.
pub fn frame<T: Columns>(rows: Vec<T>) -> Result<DataFrame> {
    let n = rows.len();
    Ok(DataFrame::new(n, T::columns("", rows))?)
}

/// A table's rows as a record type (columns by name, types checked).
pub fn rows<T: Columns>(df: &DataFrame) -> Result<Vec<T>> {
    T::read(df, "")
}

/// The schema of a record type as a Markdown table.
pub fn schema_markdown<T: Columns>() -> String {
    let mut s = String::from("| column | type | meaning |\n| --- | --- | --- |\n");
    for (name, ty, doc) in T::schema("", "") {
        s.push_str(&format!(
            "| `{name}` | {ty} | {} |\n",
            doc.replace('\n', " ")
        ));
    }
    s
}
