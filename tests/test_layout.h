/* tests/test_layout.h — the maps that cannot drift: each file's list of its sections against the
 * section banners themselves (host tests; they read the sources, so run from the repository root:
 * elsewhere they skip naming the file, and fail under MT_TEST_STRICT=1).
 *
 * A banner is a one-line comment "N. Title" (a subsection "N.M Title") right after a rule, a comment
 * line of '=' (megatron.cu) or '-' (megatron.h).
 *   megatron.cu  the numbered list after "Contents" in its opening comment against its banners.
 *   megatron.h   the numbered list after "Sections" (or "Contents") in its opening comment against
 *                its declaration banners. A number whose banner appears twice (declarations, then
 *                implementation) must keep its title, and each one-line implementation banner
 *                (a comment "N. Title" filled out with '-') must name a listed section by its number
 *                and title.
 *   DESIGN.md    under a heading that names megatron.cu or megatron.h, a numbered list of bold
 *                titles (`N. **Title**`) must hold that file's top-level section numbers, each with
 *                its banner's title (an N.M it lists must be a subsection banner too); the list under
 *                megatron.cu's heading must be there. Every "megatron.cu section N" and "megatron.h
 *                section N" in the three files must name a section that exists (only that: prose
 *                cannot say which section it meant).
 *
 * Parsing is by numbers and titles only, so it holds whatever the files say. Titles are compared
 * after one normalisation (tl_norm): the text up to the first '(', ':' or ';' (what follows is
 * detail a list or a banner may add or leave out), markdown's ** and a trailing '.' or ',' dropped,
 * runs of spaces made one, case ignored. "12. FP8" in a list thus matches the banner "12. FP8:
 * formats, scaling, casts and transposes", while a word added, dropped or changed before those marks
 * fails ("Bias, residual and activations" against the banner "Bias, residual, dropout and
 * activations"), and so does an entry missing, extra or renumbered.
 *
 * The seam (layout_seam_holds): in megatron.cu's code (comments and literals blanked), from its
 * "PART I" banner to its "PART II" banner no identifier starts with mt_trainer or mt_config, and
 * after "PART II" no kernel is defined or launched (__global__, __device__, <<<).
 *
 * layout_checks_can_fail runs the checks on altered copies (megatron.cu's first list entry renamed,
 * dropped or renumbered; its banner renamed; DESIGN.md's first entry of megatron.cu renumbered; a
 * launch added to Part II; mt_config added to Part I) and passes only when the unaltered megatron.cu
 * and DESIGN.md pass and every copy fails. */
#ifndef MT_TEST_LAYOUT_H
#define MT_TEST_LAYOUT_H

#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "test_common.h"

#define TL_MAX 128 /* sections (with subsections) one file may list */

typedef struct {
    char num[16];    /* "5", "9.2" */
    char title[160]; /* normalised (tl_norm) */
    int line;        /* 1-based, in its file */
} tl_entry;

typedef struct {
    tl_entry e[TL_MAX];
    int n;
} tl_list;

/* One line of text (no newline), its length and number. */
typedef struct {
    const char* p;
    int len;
    int line;
} tl_line;

/* The next line of the text at *at (NULL: none left). */
static int tl_next(const char** at, int* line_no, tl_line* out) {
    if (!*at || !**at) return 0;
    const char* nl = strchr(*at, '\n');
    out->p = *at;
    out->len = nl ? (int)(nl - *at) : (int)strlen(*at);
    out->line = ++*line_no;
    *at = nl ? nl + 1 : NULL;
    return 1;
}

/* The normalisation every title goes through before comparing (see the top of this file). */
static void tl_norm(const char* s, int len, char* out, size_t cap) {
    size_t n = 0;
    int space = 0;
    for (int i = 0; i < len && s[i] != '(' && s[i] != ':' && s[i] != ';'; i++) {
        if (s[i] == '*') continue;
        if (isspace((unsigned char)s[i])) {
            space = n > 0;
            continue;
        }
        if (space && n + 1 < cap) out[n++] = ' ';
        space = 0;
        if (n + 1 < cap) out[n++] = (char)tolower((unsigned char)s[i]);
    }
    while (n > 0 && (out[n - 1] == '.' || out[n - 1] == ',' || out[n - 1] == ' ')) n--;
    out[n] = 0;
}

/* A section number at s: digits, optionally ".digits" (a subsection), optionally a '.' after it, then
 * at least one space. Returns the characters taken (0: none), the number in num. */
static int tl_number(const char* s, int len, char* num, size_t cap) {
    int i = 0;
    while (i < len && isdigit((unsigned char)s[i])) i++;
    if (i == 0 || i > 4) return 0;
    if (i + 1 < len && s[i] == '.' && isdigit((unsigned char)s[i + 1])) {
        i++;
        while (i < len && isdigit((unsigned char)s[i])) i++;
    }
    snprintf(num, cap, "%.*s", i, s);
    if (i < len && s[i] == '.') i++;
    if (i >= len || s[i] != ' ') return 0;
    while (i < len && s[i] == ' ') i++;
    return i;
}

static const tl_entry* tl_find(const tl_list* l, const char* num) {
    for (int i = 0; i < l->n; i++)
        if (!strcmp(l->e[i].num, num)) return &l->e[i];
    return NULL;
}

/* Adds (num, title of len chars) to l; 0 when l is full. */
static int tl_add(tl_list* l, const char* num, const char* title, int len, int line) {
    if (l->n >= TL_MAX) return 0;
    tl_entry* e = &l->e[l->n++];
    snprintf(e->num, sizeof(e->num), "%s", num);
    tl_norm(title, len, e->title, sizeof(e->title));
    e->line = line;
    return 1;
}

/* A rule: a comment line whose text starts with at least 16 of '=' or of '-'. */
static int tl_is_rule(const tl_line* l) {
    if (l->len < 19 || strncmp(l->p, "/* ", 3) != 0 || (l->p[3] != '=' && l->p[3] != '-')) return 0;
    for (int i = 3; i < 19; i++)
        if (l->p[i] != l->p[3]) return 0;
    return 1;
}

/* The text of a one-line comment without its markers, trailing spaces and a trailing run of '-'
 * (the implementation banners' fill); -1 when the line is no such comment. */
static int tl_comment_text(const tl_line* l, const char** text) {
    int end = l->len;
    while (end > 0 && l->p[end - 1] == ' ') end--;
    if (end < 5 || strncmp(l->p, "/* ", 3) != 0 || strncmp(l->p + end - 2, "*/", 2) != 0) return -1;
    end -= 2;
    while (end > 3 && (l->p[end - 1] == ' ' || l->p[end - 1] == '-')) end--;
    *text = l->p + 3;
    return end - 3;
}

/* Writes the problem into why (for the failing test's line) and returns 0. */
static int tl_fail(char* why, size_t cap, const char* fmt, ...) __attribute__((format(printf, 3, 4)));
static int tl_fail(char* why, size_t cap, const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, cap, fmt, ap);
    va_end(ap);
    return 0;
}

/* The section banners of a source file: the title line right after a rule. A number seen twice must
 * keep its title (megatron.h's declarations and implementation); the first is kept. */
static int tl_banners(const char* name, const char* text, tl_list* out, char* why, size_t cap) {
    out->n = 0;
    const char* at = text;
    int line_no = 0, after_rule = 0;
    tl_line l;
    while (tl_next(&at, &line_no, &l)) {
        const int rule = tl_is_rule(&l);
        if (!rule && after_rule) {
            const char* t;
            int len = tl_comment_text(&l, &t);
            char num[16];
            int k = len > 0 ? tl_number(t, len, num, sizeof(num)) : 0;
            if (k > 0) {
                const tl_entry* seen = tl_find(out, num);
                tl_entry e;
                tl_norm(t + k, len - k, e.title, sizeof(e.title));
                if (seen && strcmp(seen->title, e.title) != 0)
                    return tl_fail(why, cap, "%s:%d: the banner of section %s says \"%s\", the one at line %d \"%s\"", name,
                                   l.line, num, e.title, seen->line, seen->title);
                if (!seen && !tl_add(out, num, t + k, len - k, l.line))
                    return tl_fail(why, cap, "%s: more than %d banners", name, TL_MAX);
            }
        }
        after_rule = rule;
    }
    if (out->n == 0) return tl_fail(why, cap, "%s: no section banners (a rule line, then \"/* N. Title */\")", name);
    return 1;
}

/* The one-line banners "N. Title" filled out with '-' to the comment's end (megatron.h's
 * implementation part). */
static void tl_dash_banners(const char* text, tl_list* out) {
    out->n = 0;
    const char* at = text;
    int line_no = 0;
    tl_line l;
    while (tl_next(&at, &line_no, &l)) {
        if (l.len < 12 || strncmp(l.p + l.len - 6, "--- */", 6) != 0 || tl_is_rule(&l)) continue;
        const char* t;
        int len = tl_comment_text(&l, &t);
        char num[16];
        int k = len > 0 ? tl_number(t, len, num, sizeof(num)) : 0;
        if (k > 0) tl_add(out, num, t + k, len - k, l.line);
    }
}

/* The numbered list of the file's opening comment: the entries after the line that starts with one
 * of the headings (" * Contents", " * Sections"), to the first empty comment line after an entry.
 * Lines without a number (a heading's second line, "Part I: ...", an entry's continuation) are
 * skipped. */
static int tl_contents(const char* name, const char* text, const char* const headings[], tl_list* out, char* why,
                       size_t cap) {
    out->n = 0;
    if (strncmp(text, "/*", 2) != 0) return tl_fail(why, cap, "%s: does not open with a comment", name);
    const char* end = strstr(text, "*/");
    if (!end) return tl_fail(why, cap, "%s: the opening comment does not end", name);
    const char* at = text;
    int line_no = 0, in_list = 0;
    tl_line l;
    while (tl_next(&at, &line_no, &l) && l.p < end) {
        int i = 0;
        while (i < l.len && (l.p[i] == ' ' || l.p[i] == '*' || l.p[i] == '/')) i++;
        const char* t = l.p + i;
        const int len = l.len - i;
        if (!in_list) {
            for (int h = 0; headings[h]; h++)
                if (len >= (int)strlen(headings[h]) && !strncmp(t, headings[h], strlen(headings[h]))) in_list = 1;
            continue;
        }
        if (len == 0) {
            if (out->n > 0) break;
            continue;
        }
        char num[16];
        const int k = tl_number(t, len, num, sizeof(num));
        if (k == 0) continue;
        if (tl_find(out, num)) return tl_fail(why, cap, "%s:%d: the contents list has section %s twice", name, l.line, num);
        if (!tl_add(out, num, t + k, len - k, l.line)) return tl_fail(why, cap, "%s: more than %d entries", name, TL_MAX);
    }
    if (out->n == 0)
        return tl_fail(why, cap, "%s: no numbered contents list after \"%s\" in its opening comment", name, headings[0]);
    return 1;
}

/* A list (in list_file, called `what` there) against a file's banners: the same numbers (every one
 * when `all`; else every top-level one, and a subsection only if the list has it), each with the
 * banner's title. */
static int tl_compare(const char* list_file, const char* what, const tl_list* list, const char* file_name,
                      const tl_list* banners, int all, char* why, size_t cap) {
    for (int i = 0; i < list->n; i++) {
        const tl_entry* e = &list->e[i];
        const tl_entry* b = tl_find(banners, e->num);
        if (!b)
            return tl_fail(why, cap, "%s:%d: %s has section %s \"%s\", which has no banner in %s", list_file, e->line, what,
                           e->num, e->title, file_name);
        if (strcmp(e->title, b->title) != 0)
            return tl_fail(why, cap, "%s:%d: %s has section %s as \"%s\", its banner (%s:%d) as \"%s\"", list_file,
                           e->line, what, e->num, e->title, file_name, b->line, b->title);
    }
    for (int i = 0; i < banners->n; i++) {
        const tl_entry* b = &banners->e[i];
        if (!all && strchr(b->num, '.')) continue;
        if (!tl_find(list, b->num))
            return tl_fail(why, cap, "%s: %s lacks section %s \"%s\" (banner at %s:%d)", list_file, what, b->num, b->title,
                           file_name, b->line);
    }
    return 1;
}

/* megatron.cu's contents against its banners. */
static int tl_check_cu(const char* text, tl_list* banners, char* why, size_t cap) {
    static const char* const headings[] = {"Contents", NULL};
    tl_list list;
    return tl_banners("megatron.cu", text, banners, why, cap) &&
           tl_contents("megatron.cu", text, headings, &list, why, cap) &&
           tl_compare("megatron.cu", "the contents list", &list, "megatron.cu", banners, 1, why, cap);
}

/* megatron.h's section list against its declaration banners and its implementation banners. */
static int tl_check_h(const char* text, tl_list* banners, char* why, size_t cap) {
    static const char* const headings[] = {"Sections", "Contents", NULL};
    tl_list list, impl;
    if (!tl_banners("megatron.h", text, banners, why, cap) || !tl_contents("megatron.h", text, headings, &list, why, cap) ||
        !tl_compare("megatron.h", "the section list", &list, "megatron.h", banners, 1, why, cap))
        return 0;
    tl_dash_banners(text, &impl);
    for (int i = 0; i < impl.n; i++) {
        const tl_entry* e = &impl.e[i];
        const tl_entry* b = tl_find(&list, e->num);
        if (!b || strcmp(b->title, e->title) != 0)
            return tl_fail(why, cap, "megatron.h:%d: the implementation's banner \"%s. %s\" names no listed section (%s)",
                           e->line, e->num, e->title, b ? b->title : "no such number");
    }
    return 1;
}

/* DESIGN.md's numbered section lists and section references against the files' banners. */
static int tl_check_design(const char* text, const tl_list* cu, const tl_list* h, char* why, size_t cap) {
    tl_list lists[2];
    lists[0].n = lists[1].n = 0;
    const tl_list* banners[2] = {cu, h};
    const char* names[2] = {"megatron.cu", "megatron.h"};
    const char* at = text;
    int line_no = 0, target = -1;
    tl_line l;
    while (tl_next(&at, &line_no, &l)) {
        if (l.len > 0 && l.p[0] == '#') { /* a heading: whose list follows, if any */
            const char* ends[2] = {NULL, NULL};
            for (int f = 0; f < 2; f++) {
                for (const char* s = l.p; (s = strstr(s, names[f])) && s < l.p + l.len; s++) {
                    const char c = s[strlen(names[f])]; /* megatron.h, not megatron.hpp */
                    if (!isalnum((unsigned char)c) && c != '_') { ends[f] = s; break; }
                }
            }
            target = ends[0] && (!ends[1] || ends[0] < ends[1]) ? 0 : ends[1] ? 1 : -1;
            continue;
        }
        char num[16];
        const int k = target >= 0 ? tl_number(l.p, l.len, num, sizeof(num)) : 0;
        if (k == 0 || k + 2 > l.len || strncmp(l.p + k, "**", 2) != 0) continue;
        const char* title = l.p + k + 2;
        const char* close = strstr(title, "**");
        if (!close || close > l.p + l.len) continue;
        if (tl_find(&lists[target], num))
            return tl_fail(why, cap, "DESIGN.md:%d: lists %s's section %s twice", l.line, names[target], num);
        if (!tl_add(&lists[target], num, title, (int)(close - title), l.line))
            return tl_fail(why, cap, "DESIGN.md: more than %d entries", TL_MAX);
    }
    if (lists[0].n == 0)
        return tl_fail(why, cap, "DESIGN.md: no numbered list of megatron.cu's sections (N. **Title**) under a heading "
                                 "naming megatron.cu");
    for (int f = 0; f < 2; f++) {
        char what[64];
        snprintf(what, sizeof(what), "the list of %s's sections", names[f]);
        if (lists[f].n > 0 && !tl_compare("DESIGN.md", what, &lists[f], names[f], banners[f], 0, why, cap)) return 0;
    }
    return 1;
}

/* Every "megatron.cu section N" / "megatron.h section N" (also "sections N") in text names a section. */
static int tl_check_references(const char* name, const char* text, const tl_list* cu, const tl_list* h, char* why,
                               size_t cap) {
    const char* names[2] = {"megatron.cu section", "megatron.h section"};
    const tl_list* banners[2] = {cu, h};
    for (int f = 0; f < 2; f++)
        for (const char* s = text; (s = strstr(s, names[f])) != NULL; s++) {
            const char* p = s + strlen(names[f]);
            if (*p == 's') p++;
            if (*p != ' ') continue;
            p++;
            char num[16];
            int i = 0;
            while (i < 15 && (isdigit((unsigned char)p[i]) || (p[i] == '.' && isdigit((unsigned char)p[i + 1])))) i++;
            if (i == 0) continue;
            snprintf(num, sizeof(num), "%.*s", i, p);
            if (!tl_find(banners[f], num)) {
                int line = 1;
                for (const char* c = text; c < s; c++) line += *c == '\n';
                return tl_fail(why, cap, "%s:%d: \"%s %s\": there is no such section", name, line, names[f], num);
            }
        }
    return 1;
}

/* The three files, read from the working directory; 0 (reason in why) when one is missing. */
typedef struct {
    char *cu, *h, *design;
} tl_sources;

static const char* tl_read_all(tl_sources* s) {
    static const char* const files[3] = {"megatron.cu", "megatron.h", "DESIGN.md"};
    char** dst[3] = {&s->cu, &s->h, &s->design};
    for (int i = 0; i < 3; i++)
        if (!(*dst[i] = test_read_file(files[i], NULL))) return files[i];
    return NULL;
}

static void tl_free(tl_sources* s) {
    free(s->cu);
    free(s->h);
    free(s->design);
}

#define TL_READ_OR_SKIP(s)                                                                       \
    do {                                                                                         \
        const char* missing_ = tl_read_all(&(s));                                                \
        if (missing_) {                                                                          \
            tl_free(&(s));                                                                       \
            SKIP_OR_FAIL_STRICT("no %s here (run from the repository root)", missing_);          \
        }                                                                                        \
    } while (0)

/* megatron.cu's contents list against its banners. */
static test_result test_layout_megatron_cu_contents(void) {
    tl_sources s = {NULL, NULL, NULL};
    TL_READ_OR_SKIP(s);
    static tl_list cu; /* static: 23 KB */
    char why[512] = "";
    const int ok = tl_check_cu(s.cu, &cu, why, sizeof(why));
    tl_free(&s);
    EXPECT(ok, "%s", why);
    printf("    %d sections and subsections, listed as in their banners\n", cu.n);
    return TEST_PASS;
}

/* megatron.h's section list against its declaration and implementation banners. */
static test_result test_layout_megatron_h_contents(void) {
    tl_sources s = {NULL, NULL, NULL};
    TL_READ_OR_SKIP(s);
    static tl_list h;
    char why[512] = "";
    const int ok = tl_check_h(s.h, &h, why, sizeof(why));
    tl_free(&s);
    EXPECT(ok, "%s", why);
    printf("    %d sections, listed as in their banners\n", h.n);
    return TEST_PASS;
}

/* DESIGN.md's lists of the two files' sections, and every "megatron.cu/.h section N" in the three
 * files, against the banners. */
static test_result test_layout_design_lists(void) {
    tl_sources s = {NULL, NULL, NULL};
    TL_READ_OR_SKIP(s);
    static tl_list cu, h;
    char why[512] = "";
    const int ok = tl_banners("megatron.cu", s.cu, &cu, why, sizeof(why)) &&
                   tl_banners("megatron.h", s.h, &h, why, sizeof(why)) &&
                   tl_check_design(s.design, &cu, &h, why, sizeof(why)) &&
                   tl_check_references("DESIGN.md", s.design, &cu, &h, why, sizeof(why)) &&
                   tl_check_references("megatron.cu", s.cu, &cu, &h, why, sizeof(why)) &&
                   tl_check_references("megatron.h", s.h, &cu, &h, why, sizeof(why));
    tl_free(&s);
    EXPECT(ok, "%s", why);
    return TEST_PASS;
}

/* megatron.cu's code (comments, string and character literals blanked, lines kept): what the seam's
 * rule is about. A new string. */
static char* tl_code_only(const char* text) {
    const size_t n = strlen(text);
    char* out = (char*)malloc(n + 1);
    if (!out) return NULL;
    enum { CODE, BLOCK, LINE, STR, CHR } st = CODE;
    for (size_t i = 0; i < n; i++) {
        const char c = text[i], next = i + 1 < n ? text[i + 1] : 0;
        char o = c;
        switch (st) {
            case CODE:
                if (c == '/' && next == '*') st = BLOCK, o = ' ';
                else if (c == '/' && next == '/') st = LINE, o = ' ';
                else if (c == '"') st = STR;
                else if (c == '\'') st = CHR;
                break;
            case BLOCK:
                if (c == '*' && next == '/') {
                    out[i] = out[i + 1] = ' ';
                    i++;
                    st = CODE;
                    continue;
                }
                if (c != '\n') o = ' ';
                break;
            case LINE:
                if (c == '\n') st = CODE;
                else o = ' ';
                break;
            case STR:
            case CHR:
                if (c == '\\' && next) {
                    out[i] = ' ';
                    out[i + 1] = next == '\n' ? '\n' : ' ';
                    i++;
                    continue;
                }
                if (c == (st == STR ? '"' : '\'')) st = CODE;
                else if (c != '\n') o = ' ';
                break;
        }
        out[i] = o;
    }
    out[n] = 0;
    return out;
}

/* The seam of megatron.cu (its opening comment states it): from the "PART I" banner to the "PART II"
 * banner no identifier starts with mt_trainer or mt_config; after "PART II" no kernel is defined or
 * launched (no __global__, __device__ or <<<). */
static int tl_check_seam(const char* text, char* why, size_t cap) {
    const char* p1 = strstr(text, "\n/* PART I:");
    const char* p2 = strstr(text, "\n/* PART II:");
    if (!p1 || !p2 || p2 < p1)
        return tl_fail(why, cap, "megatron.cu: no \"/* PART I:\" banner followed by a \"/* PART II:\" banner");
    char* code = tl_code_only(text);
    if (!code) return tl_fail(why, cap, "out of memory");
    const char* c1 = code + (p1 - text);
    const char* c2 = code + (p2 - text);
    static const char* const part1[] = {"mt_trainer", "mt_config"};
    static const char* const part2[] = {"__global__", "__device__", "<<<"};
    const char* bad = NULL;
    const char* what = NULL;
    for (int k = 0; k < 2 && !bad; k++)
        for (const char* s = c1; (s = strstr(s, part1[k])) && s < c2; s++)
            if (s == code || !(isalnum((unsigned char)s[-1]) || s[-1] == '_')) {
                bad = s;
                what = part1[k];
                break;
            }
    for (int k = 0; k < 3 && !bad; k++)
        if ((bad = strstr(c2, part2[k]))) what = part2[k];
    int line = 1;
    const int in_part1 = bad && bad < c2;
    if (bad)
        for (const char* c = code; c < bad; c++) line += *c == '\n';
    free(code);
    if (bad)
        return tl_fail(why, cap, "megatron.cu:%d: %s in Part %s (the seam: Part I never sees mt_trainer or mt_config, "
                                 "Part II launches kernels only through Part I's launchers)",
                       line, what, in_part1 ? "I" : "II");
    return 1;
}

static test_result test_layout_seam_holds(void) {
    tl_sources s = {NULL, NULL, NULL};
    TL_READ_OR_SKIP(s);
    char why[512] = "";
    const int ok = tl_check_seam(s.cu, why, sizeof(why));
    tl_free(&s);
    EXPECT(ok, "%s", why);
    return TEST_PASS;
}

/* Replaces the first occurrence of `from` at or after `after` in text by `to` (a new string). */
static char* tl_edit(const char* text, const char* after, const char* from, const char* to) {
    const char* a = strstr(text, after);
    const char* f = a ? strstr(a, from) : NULL;
    if (!f) return NULL;
    const size_t n = strlen(text), nf = strlen(from), nt = strlen(to);
    char* out = (char*)malloc(n - nf + nt + 1);
    if (!out) return NULL;
    memcpy(out, text, (size_t)(f - text));
    memcpy(out + (f - text), to, nt);
    memcpy(out + (f - text) + nt, f + nf, n - (size_t)(f - text) - nf + 1);
    return out;
}

/* The checks fail on broken copies: the first entry of megatron.cu's list renamed, dropped or
 * renumbered, its banner renamed, and DESIGN.md's first megatron.cu entry renumbered. Each copy is
 * made by finding the first list entry (the first "1. " after "Contents") and its banner. */
static test_result test_layout_checks_can_fail(void) {
    tl_sources s = {NULL, NULL, NULL};
    TL_READ_OR_SKIP(s);
    static tl_list cu, h;
    char why[512] = "";
    test_result res = TEST_FAIL;
    char* broken = NULL;
    do {
        /* the unbroken megatron.cu and DESIGN.md pass (megatron.h: its banners only, for DESIGN.md) */
        if (!tl_check_cu(s.cu, &cu, why, sizeof(why)) || !tl_banners("megatron.h", s.h, &h, why, sizeof(why)) ||
            !tl_check_design(s.design, &cu, &h, why, sizeof(why)) || !tl_check_seam(s.cu, why, sizeof(why))) {
            printf("    FAIL the unbroken files: %s\n", why);
            break;
        }
        /* the first entry's line in the list, "1. <title>" up to the line's end */
        const char* contents = strstr(s.cu, "Contents");
        const char* first = contents ? strstr(contents, "1. ") : NULL;
        const char* eol = first ? strchr(first, '\n') : NULL;
        if (!eol) {
            printf("    FAIL no \"1. \" after \"Contents\" in megatron.cu\n");
            break;
        }
        char entry[200], title[200], cases[5][2][220];
        snprintf(entry, sizeof(entry), "%.*s", (int)(eol - first), first); /* "1. Checks, ..." */
        snprintf(title, sizeof(title), "%s", entry + 3);
        /* list: renamed (a word added), dropped (a line that is no entry), renumbered (1 -> 22) */
        snprintf(cases[0][0], 220, "%s", entry);
        snprintf(cases[0][1], 220, "1. Some %s", title);
        snprintf(cases[1][0], 220, "%s", entry);
        snprintf(cases[1][1], 220, "(none) %s", title);
        snprintf(cases[2][0], 220, "%s", entry);
        snprintf(cases[2][1], 220, "22. %s", title);
        int failed_all = 1;
        for (int c = 0; c < 3 && failed_all; c++) {
            free(broken);
            broken = tl_edit(s.cu, "Contents", cases[c][0], cases[c][1]);
            tl_list b;
            char w[512] = "";
            const int ok = broken && tl_check_cu(broken, &b, w, sizeof(w));
            printf("    list entry \"%s\" -> \"%s\": %s\n", cases[c][0], cases[c][1], ok ? "not caught" : w);
            failed_all = broken && !ok;
        }
        /* the banner renamed: its title line after the opening comment */
        char banner[220], renamed[240];
        snprintf(banner, sizeof(banner), "/* %s", entry);
        snprintf(renamed, sizeof(renamed), "/* 1. Some %s", title);
        renamed[strlen(banner)] = 0; /* the same length: the banner's padding is kept */
        free(broken);
        broken = tl_edit(s.cu, "*/", banner, renamed);
        {
            tl_list b;
            char w[512] = "";
            const int ok = broken && tl_check_cu(broken, &b, w, sizeof(w));
            printf("    banner \"%s\" -> \"%s\": %s\n", banner, renamed, ok ? "not caught" : w);
            failed_all = failed_all && broken && !ok;
        }
        /* DESIGN.md's first megatron.cu entry renumbered */
        free(broken);
        broken = tl_edit(s.design, "## megatron.cu", "\n1. **", "\n22. **");
        {
            char w[512] = "";
            const int ok = broken && tl_check_design(broken, &cu, &h, w, sizeof(w));
            printf("    DESIGN.md \"1. **\" -> \"22. **\": %s\n", ok ? "not caught" : w);
            failed_all = failed_all && broken && !ok;
        }
        /* the seam: a launch in Part II, mt_config in Part I (code, not a comment) */
        const char* seam_cases[2][3] = {
            {"\n/* PART II:", "\nstatic void ", "\nstatic void tl_kernel<<<1, 1>>>(); static void "},
            {"\n/* PART I:", "\nstatic void ", "\nstatic mt_config tl_c; static void "}};
        for (int c = 0; c < 2; c++) {
            free(broken);
            broken = tl_edit(s.cu, seam_cases[c][0], seam_cases[c][1], seam_cases[c][2]);
            char w[512] = "";
            const int ok = broken && tl_check_seam(broken, w, sizeof(w));
            printf("    seam (%s added): %s\n", c == 0 ? "a launch in Part II" : "mt_config in Part I", ok ? "not caught" : w);
            failed_all = failed_all && broken && !ok;
        }
        if (!failed_all) {
            printf("    FAIL a broken copy passed the checks (or could not be made)\n");
            break;
        }
        res = TEST_PASS;
    } while (0);
    free(broken);
    tl_free(&s);
    return res;
}

static const test_case layout_tests[] = {
    {"layout_megatron_cu_contents", test_layout_megatron_cu_contents},
    {"layout_megatron_h_contents", test_layout_megatron_h_contents},
    {"layout_design_lists", test_layout_design_lists},
    {"layout_seam_holds", test_layout_seam_holds},
    {"layout_checks_can_fail", test_layout_checks_can_fail},
};

#endif
