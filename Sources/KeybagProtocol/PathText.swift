/// Path arithmetic on text, for the places Foundation's `NSString` path methods would serve:
/// swift-corelibs-foundation 6.3.1 traps in `deletingLastPathComponent` on a one-character
/// relative path (`s`), `.`, or a name with a trailing slash (`a/`), all of which a user can
/// type as `--socket`, `--device-key` or a path given to the tools.
public enum PathText {
    /// The folder part of `path`, as `NSString.deletingLastPathComponent` defines it:
    /// trailing slashes dropped, then everything before the last slash ("" for a bare name,
    /// "/" for a name at the root, "/" for "/").
    public static func parent(_ path: String) -> String {
        var p = Substring(path)
        while p.count > 1 && p.hasSuffix("/") { p = p.dropLast() }
        if p == "/" { return "/" }
        guard let slash = p.lastIndex(of: "/") else { return "" }
        var head = p[..<slash]
        while head.count > 1 && head.hasSuffix("/") { head = head.dropLast() }
        return head.isEmpty ? "/" : String(head)
    }
}
