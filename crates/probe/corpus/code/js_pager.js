// Splits a list of records into pages and renders a page summary.
function pageCount(total, size) {
  if (size <= 0) {
    throw new RangeError("page size must be positive");
  }
  return Math.ceil(total / size);
}

function paginate(records, size, page) {
  const pages = pageCount(records.length, size);
  const index = Math.min(Math.max(page, 1), Math.max(pages, 1));
  const start = (index - 1) * size;
  const items = records.slice(start, start + size);
  return {
    items,
    page: index,
    pages,
    hasNext: index < pages,
    hasPrev: index > 1,
  };
}

function renderSummary(result) {
  const first = result.items[0];
  const last = result.items[result.items.length - 1];
  let text = "page " + result.page + " of " + result.pages;
  if (first && last) {
    text += ` (ids ${first.id}-${last.id})`;
  }
  if (result.hasNext) {
    text += " ->";
  }
  return text;
}

const records = [];
for (let i = 1; i <= 23; i++) {
  records.push({ id: i, name: `record-${i}` });
}
let view = paginate(records, 5, 1);
console.log(renderSummary(view));
view = paginate(records, 5, view.page + 1);
console.log(renderSummary(view));
view = paginate(records, 5, 99);
console.log(renderSummary(view));
