import statistics


WEIGHTS = {"homework": 0.3, "midterm": 0.3, "final": 0.4}


def weighted_score(scores):
    result = 0.0
    for part, weight in WEIGHTS.items():
        result += scores.get(part, 0) * weight
    return result


def letter(score):
    if score >= 90:
        return "A"
    elif score >= 80:
        return "B"
    elif score >= 70:
        return "C"
    return "F"


def summarize(students):
    report = {}
    totals = []
    for name, scores in students.items():
        value = weighted_score(scores)
        totals.append(value)
        report[name] = (round(value, 1), letter(value))
    mean = statistics.mean(totals)
    spread = max(totals) - min(totals)
    return report, mean, spread


def curve(students, target=75):
    _, mean, _ = summarize(students)
    shift = target - mean
    if shift <= 0:
        return students
    curved = {}
    for name, scores in students.items():
        curved[name] = {k: min(v + shift, 100) for k, v in scores.items()}
    return curved


classroom = {
    "ana": {"homework": 92, "midterm": 81, "final": 88},
    "ben": {"homework": 70, "midterm": 64, "final": 59},
    "eve": {"homework": 85, "midterm": 90, "final": 77},
}
print(summarize(curve(classroom)))
