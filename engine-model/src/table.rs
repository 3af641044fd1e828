//! The terminal table the replay and the lab print their results in (`comfy-table`):
//! borderless, the header over a dashed rule, the first column (the policy) left-aligned
//! and the numbers right-aligned, two spaces between columns, no trailing spaces.
//!
//! One style for both reports, so a replay's table and a lab's table of the same
//! policies read alike. Rendering is `O(cells)` string formatting.

use comfy_table::{CellAlignment, Table};

/// `comfy-table` preset: only the line under the header (position 6 of 19).
const HEADER_RULE_ONLY: &str = "     --            ";

/// `header` over `rows` (each as long as `header`), as lines without a final newline.
pub fn render_table(header: &[&str], rows: impl IntoIterator<Item = Vec<String>>) -> String {
    let mut table = Table::new();
    table
        .load_preset(HEADER_RULE_ONLY)
        .set_header(header.to_vec())
        .add_rows(rows);
    for (i, column) in table.column_iter_mut().enumerate() {
        let alignment = if i == 0 {
            CellAlignment::Left
        } else {
            CellAlignment::Right
        };
        column.set_cell_alignment(alignment);
        // The unlined column separator is one blank; one more before each number
        // column makes the two spaces between columns.
        column.set_padding((u16::from(i != 0), 0));
    }
    table.trim_fmt()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligns_columns_under_a_rule() {
        let table = render_table(
            &["policy", "hit rate", "p99"],
            [
                vec!["kv".to_owned(), "50.0%".to_owned(), "1200".to_owned()],
                vec!["round-robin".to_owned(), "5.0%".to_owned(), "7".to_owned()],
            ],
        );
        let lines: Vec<&str> = table.lines().collect();
        assert_eq!(
            lines,
            [
                "policy       hit rate   p99",
                "---------------------------",
                "kv              50.0%  1200",
                "round-robin      5.0%     7",
            ],
            "{table}"
        );
    }
}
